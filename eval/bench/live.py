"""Live benchmark: plain decoding against speculative decoding on the same prompts.

    python eval/bench/live.py --config CFG --run-dir RUN [--set bench.repetitions=5]

The stage in order: the backend `bench.backend` selects, `embedded` (eval/bench/embedded_backend.py: transformers
target + eval/decode/speculate.py, batch 1, chain drafting: topk 1) or `sglang` (eval/bench/sglang_backend.py: live
SGLang servers); the prompt sets rendered once with its target's tokenizer (data/render.py); the interleaved
runs (eval/bench/schedule.py: runs.jsonl, summary.json); then the run's economics (eval/economics/analysis.py:
economics.json, calibration.json). With the embedded backend, `bench.drafters` and `bench.more_prompts` bench more
drafters and prompt sets in the same interleaved run.
"""

from __future__ import annotations

from pathlib import Path

from eagle3ft.cli import cli_errors, error_log, parse_cli
from eagle3ft.data.render import load_prompt_sets
from eagle3ft.data.store import StoreError
from eagle3ft.eval.bench import schedule
from eagle3ft.eval.bench.backend import BenchBackend
from eagle3ft.eval.bench.embedded_backend import EmbeddedBackend
from eagle3ft.eval.bench.format import format_summary
from eagle3ft.eval.bench.sglang_backend import SGLangBackend
from eagle3ft.eval.economics.analysis import after_bench
from eagle3ft.eval.preflight import check_or_exit
from eagle3ft.runlock import holding
from eagle3ft.targets.sglang_http import SGLangError


def make_backend(cfg, run_dir: Path) -> BenchBackend:
    if cfg.bench.backend == "embedded":
        return EmbeddedBackend(cfg, run_dir)
    if cfg.bench.backend == "sglang":
        if cfg.bench.drafters:
            raise ValueError("bench.drafters: the sglang backend benches one drafter (eval.checkpoint); leave it empty")
        return SGLangBackend(cfg, run_dir)
    raise ValueError(f"bench.backend {cfg.bench.backend!r}: expected embedded or sglang")


def run(cfg, run_dir: Path, log=print) -> dict:
    """The benchmark on the configured backend, closed (servers stopped) at the end, then the run's economics;
    returns the bench's summary."""
    backend = make_backend(cfg, run_dir)
    try:
        summary = schedule.run(cfg, run_dir, backend, load_prompt_sets(cfg, backend.tokenizer), log)
    finally:
        if hasattr(backend, "close"):
            backend.close()
    after_bench(run_dir, cfg, log)
    return summary


def main(argv: list[str] | None = None) -> None:

    cfg, run_dir, args = parse_cli("Live benchmark: plain against speculative decoding.", stage="bench", argv=argv)
    check_or_exit("live.py", "bench", cfg, run_dir, args.config)
    with (
        holding(run_dir, "bench", "live.py"),
        cli_errors("live.py", StoreError, SGLangError, log=error_log(run_dir, "bench")),
    ):
        print(format_summary(run(cfg, run_dir)))


if __name__ == "__main__":
    main()
