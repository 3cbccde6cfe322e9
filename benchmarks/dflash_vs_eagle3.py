"""A DFlash drafter against the EAGLE-3 drafter on the same prompts and answers, the same number of training steps:
offline τ per held-out set, side by side (CPU-sized; the stages' real entry points).

    python benchmarks/dflash_vs_eagle3.py --config configs/tiny.yaml --out runs/dflash-vs-eagle3 \
        [--dflash configs/drafters/tiny-dflash.json] [--steps 40] [--set KEY=VALUE ...]

Two run folders under OUT, one per kind, from one config: `eagle3/` (drafter.config as the config has it) and
`dflash/` (drafter.config = --dflash). Each is harvested (the same sources, seed and greedy answers: the two stores
hold the same tokens, their features the layers each kind reads), trained for --steps optimizer steps under
`accelerate launch` (one CPU process), and walked on its held-out features per held-out set (the harvest's sources
with split heldout: e.g. the everyday set and MT-Bench) as a live greedy decoder would (eval/offline/compare.py's
walk): EAGLE-3 at eval.steps/1/eval.steps+1, DFlash at its block B-1/1/B. Writes OUT/dflash_vs_eagle3.json and
prints the table. A harvest resumes chunk by chunk and a trained run (its export) is reused, so a cut run goes on.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _stage(args: list[str], config: str, run: Path, sets: list[str]) -> None:
    cmd = [*args, "--config", config, "--run-dir", str(run)]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")


def _train(config: str, run: Path, sets: list[str], steps: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu-2proc.yaml",
        "--num_processes", "1", "--main_process_port", str(port), "train/finetune.py", "--resume", "auto",
    ]  # fmt: skip
    _stage(launch, config, run, [*sets, f"train.max_steps={steps}", "train.logging.wandb_mode=disabled"])


def walks(config: str, run: Path, sets: list[str]) -> dict[str, dict]:
    """Per held-out set: the export's walk τ on all answer tokens and on the loop-free ones, and its tokens."""
    from eagle3ft.config import load_config
    from eagle3ft.drafter.folder import DrafterFolder
    from eagle3ft.eval.offline.compare import SetTotals, drafter_walks

    cfg = load_config(REPO / config, sets)
    folder = DrafterFolder.of_run(run, cfg.eval.checkpoint)
    out = {}
    for name, totals in drafter_walks(cfg.eval, cfg.target, cfg.harvest, run, {"x": folder})["x"].items():
        tau, free = SetTotals.taus(totals.sums())
        out[name] = {"tau": float(tau), "tau_loop_free": float(free), "tokens": int(totals.sums()[0])}
    B = folder.config.block_size if folder.family == "dflash" else None
    setting = f"{B - 1}/1/{B}" if B else f"{cfg.eval.steps}/1/{cfg.eval.steps + 1}"
    return {"kind": folder.family, "setting": setting, "sets": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--dflash", default="configs/drafters/tiny-dflash.json", help="the DFlash drafter.config")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps, the same for both")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE for both runs")
    a = ap.parse_args()
    kinds = {"eagle3": list(a.set), "dflash": [*a.set, f"drafter.config={a.dflash}"]}
    result = {"config": a.config, "steps": a.steps, "runs": {}}
    for kind, sets in kinds.items():
        run = a.out / kind
        _stage([sys.executable, "data/harvest.py"], a.config, run, sets)
        if not (run / "export").is_dir():
            _train(a.config, run, sets, a.steps)
        result["runs"][kind] = walks(a.config, run, sets)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "dflash_vs_eagle3.json").write_text(json.dumps(result, indent=1) + "\n")
    e, d = result["runs"]["eagle3"], result["runs"]["dflash"]
    print(f"offline τ after {a.steps} steps, the live greedy walk: EAGLE-3 at {e['setting']}, DFlash at {d['setting']}")
    print(f"{'set':<12} {'tokens':>7} {'EAGLE-3':>8} {'DFlash':>8} {'EAGLE-3 lf':>11} {'DFlash lf':>10}")
    for name in e["sets"]:
        x, y = e["sets"][name], d["sets"].get(name, {})
        print(
            f"{name:<12} {x['tokens']:>7} {x['tau']:>8.3f} {y.get('tau', float('nan')):>8.3f} "
            f"{x['tau_loop_free']:>11.3f} {y.get('tau_loop_free', float('nan')):>10.3f}"
        )


if __name__ == "__main__":
    main()
