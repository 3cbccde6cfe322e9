"""Live benchmark: plain decoding against speculative decoding on the same prompts.

    eagle3ft bench --config CFG --run-dir RUN [--set bench.repetitions=5] [--set bench.concurrency=[1,8]]
    (the same: eagle3ft-bench, python eval/bench/live.py)

The stage in order: the backend `bench.backend` selects, `embedded` (eval/bench/embedded_backend.py: transformers
target + eval/decode/speculate.py, batch 1, chain drafting: topk 1) or `sglang` (eval/bench/sglang_backend.py: live
SGLang servers); the prompt sets rendered once with its target's tokenizer (data/render.py); the interleaved
runs (eval/bench/schedule.py: runs.jsonl, summary.json); then the run's economics (eval/economics/analysis.py:
economics.json, calibration.json); on SGLang, the `bench.concurrency` levels above 1 (concurrency.json). With the
embedded backend, `bench.drafters` and `bench.more_prompts` bench more
drafters and prompt sets in the same interleaved run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from eagle3ft.cli import cli_errors, command_name, error_log, parse_cli
from eagle3ft.config import Config
from eagle3ft.data.render import load_prompt_sets
from eagle3ft.data.store import StoreError
from eagle3ft.eval.bench import schedule
from eagle3ft.eval.bench.backend import BenchBackend
from eagle3ft.eval.bench.embedded_backend import EmbeddedBackend
from eagle3ft.eval.bench.format import format_summary
from eagle3ft.eval.bench.sglang_backend import SGLangBackend, run_concurrency
from eagle3ft.eval.economics.analysis import after_bench
from eagle3ft.eval.preflight import check_or_exit
from eagle3ft.runlock import holding
from eagle3ft.targets.sglang_http import SGLangError


def make_backend(cfg: Config, run_dir: Path) -> BenchBackend:
    if cfg.bench.backend == "embedded":
        if any(c > 1 for c in cfg.bench.concurrency):
            raise ValueError(
                f"bench.concurrency {cfg.bench.concurrency}: levels above 1 run on the sglang backend; the embedded "
                "backend decodes one request at a time"
            )
        return EmbeddedBackend(cfg, run_dir)
    if cfg.bench.backend == "sglang":
        if cfg.bench.drafters:
            raise ValueError("bench.drafters: the sglang backend benches one drafter (eval.checkpoint); leave it empty")
        return SGLangBackend(cfg, run_dir)
    raise ValueError(f"bench.backend {cfg.bench.backend!r}: expected embedded or sglang")


def run(cfg: Config, run_dir: Path, log: Callable[[str], None] = print) -> dict:
    """The benchmark on the configured backend, then the run's economics, then (SGLang) the bench.concurrency levels
    above 1 on the first prompt set (RUN/bench/concurrency.json); the backend closed (servers stopped) at the end.
    Returns the bench's summary."""
    backend = make_backend(cfg, run_dir)
    try:
        sets = load_prompt_sets(cfg.target, cfg.bench, backend.tokenizer)
        summary = schedule.run(cfg.eval, cfg.bench, run_dir, backend, sets, log)
        after_bench(run_dir, cfg.bench, cfg.target, log)
        if isinstance(backend, SGLangBackend):
            run_concurrency(cfg.bench, run_dir, backend, sets[0].prompts, log)
    finally:
        if hasattr(backend, "close"):
            backend.close()
    return summary


def main(argv: list[str] | None = None) -> None:
    prog = command_name("live.py")  # in errors: the command the user typed
    cfg, run_dir, args = parse_cli("Live benchmark: plain against speculative decoding.", stage="bench", argv=argv)
    check_or_exit(prog, "bench", cfg, run_dir, args.config)
    with (
        holding(run_dir, "bench", prog),
        cli_errors(prog, StoreError, SGLangError, log=error_log(run_dir, "bench")),
    ):
        print(format_summary(run(cfg, run_dir)))


if __name__ == "__main__":
    main()
