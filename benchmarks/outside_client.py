"""Does our live bench agree with SGLang's own client? `sglang.bench_serving` (0.5.17: `sglang.benchmark.serving`)
against the same servers and prompts as `eval/bench_sglang.py`, batch 1, streamed and not, then the two side by side.

    python benchmarks/outside_client.py dataset --config CFG [--set k=v ...] --out PROMPTS.jsonl
        the bench prompts (bench.prompts) as bench_serving's custom dataset: each prompt as our bench renders it
        (chat template applied), as text; checks that the server's tokenizer gives the very ids our bench sends
    python benchmarks/outside_client.py run --arm baseline=URL --arm 8/4/32=URL --dataset PROMPTS.jsonl \
        --tokenizer MODEL_DIR --num-prompts N --output-len 512 --reps 3 --modes whole,stream --out DIR
        bench_serving in this process (one import), --max-concurrency 1, --disable-ignore-eos, T=0, the cache flushed
        before each run; the arms interleaved per repetition (A B A B); DIR/outside.json
    python benchmarks/outside_client.py compare RUN/bench/summary.json DIR/outside.json
        per arm, our e2e tok/s (non-streamed, and the streamed requests' wall) against bench_serving's: total output
        tokens over the summed e2e latency of its requests

The run needs SGLang's PYTHONPATH and the `datasets` package there (bench_serving imports it at start).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def dataset(args) -> None:
    """The prompts as rendered text. Not through bench_serving's --apply-chat-template: its custom dataset then strips
    every bos_token from the rendered text, and SmolLM2's bos_token is <|im_start|>, ChatML's turn marker."""
    from eagle3ft.config import load_config
    from eagle3ft.eval.harness import load_prompts
    from eagle3ft.targets.hf import load_tokenizer

    cfg = load_config(args.config, args.set)
    ours = load_prompts(cfg)
    tok = load_tokenizer(cfg.target)
    texts = [tok.decode(ids) for ids in ours]
    same = sum(tok(t)["input_ids"] == ids for t, ids in zip(texts, ours))  # as the server tokenizes a text prompt
    with open(args.out, "w") as f:
        for text in texts:
            row = {"conversations": [{"role": "user", "content": text}, {"role": "assistant", "content": "-"}]}
            f.write(json.dumps(row) + "\n")
    print(json.dumps({"prompts": len(texts), "same_ids_as_our_bench": same}))
    if same != len(texts):
        raise SystemExit("outside_client.py: error: the server would tokenize some prompts to other ids than ours")


def _argv(url: str, a, stream: bool, out_file: Path) -> list[str]:
    argv = [
        "bench_serving", "--backend", "sglang", "--base-url", url, "--dataset-name", "custom",
        "--dataset-path", a.dataset, "--num-prompts", str(a.num_prompts), "--sharegpt-output-len", str(a.output_len),
        "--max-concurrency", "1", "--disable-ignore-eos", "--temperature", "0", "--tokenizer", a.tokenizer, "--flush-cache", "--seed", "0", "--output-file", str(out_file),
    ]  # fmt: skip
    return argv + ([] if stream else ["--disable-stream"])


def run(a) -> None:
    from sglang.benchmark.serving import cli_main

    arms = dict(x.split("=", 1) for x in a.arm)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for rep in range(a.reps):
        for mode in a.modes.split(","):
            for arm, url in arms.items():
                f = out / f"bs-{arm.replace('/', '-')}-{mode}-{rep}.jsonl"
                sys.argv = _argv(url, a, mode == "stream", f)
                cli_main()
                res = json.loads(f.read_text().splitlines()[-1])
                e2e_s = res["mean_e2e_latency_ms"] * res["completed"] / 1e3
                rows.append(
                    {
                        "arm": arm,
                        "mode": mode,
                        "repetition": rep,
                        "completed": res["completed"],
                        "output_tokens": res["total_output_tokens"],
                        "e2e_tok_s": res["total_output_tokens"] / e2e_s,
                        "output_throughput": res["output_throughput"],
                        "mean_ttft_ms": res.get("mean_ttft_ms"),
                        "median_itl_ms": res.get("median_itl_ms"),
                        "accept_length": res.get("accept_length"),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    (out / "outside.json").write_text(json.dumps({"arms": arms, "runs": rows}, indent=1))


def compare(summary_path: str, outside_path: str) -> dict:
    """Per arm and mode: our median e2e tok/s, bench_serving's, and the difference."""
    s = json.loads(Path(summary_path).read_text())
    theirs = json.loads(Path(outside_path).read_text())["runs"]
    ours = {"baseline": s["baseline"]["figures"], **{r["key"]: r["figures"] for r in s["speculative"]}}
    out = {}
    for arm, f in ours.items():
        for mode, key in (("whole", "e2e"), ("stream", "stream_wall")):
            t = [r["e2e_tok_s"] for r in theirs if r["arm"] == arm and r["mode"] == mode]
            if not t or key not in f:
                continue
            o, m = f[key]["tok_s"]["median"], statistics.median(t)
            out[f"{arm} {mode}"] = {
                "ours": o,
                "bench_serving": m,
                "diff": o / m - 1,
                "within_5pct": abs(o / m - 1) <= 0.05,
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dataset")
    d.add_argument("--config", required=True)
    d.add_argument("--set", action="append", default=[])
    d.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--arm", action="append", required=True, help="label=URL; baseline for the plain server")
    r.add_argument("--dataset", required=True)
    r.add_argument("--tokenizer", required=True)
    r.add_argument("--num-prompts", type=int, required=True)
    r.add_argument("--output-len", type=int, default=512)
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--modes", default="whole,stream")
    r.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("summary")
    c.add_argument("outside")
    a = ap.parse_args()
    if a.cmd == "dataset":
        dataset(a)
    elif a.cmd == "run":
        run(a)
    else:
        print(json.dumps(compare(a.summary, a.outside), indent=1))


if __name__ == "__main__":
    main()
