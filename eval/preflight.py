"""What an eval or bench stage checks before it loads anything: are its inputs in the run folder?

`check(stage, cfg, run_dir, config)` returns None or one line: what is missing and the command that
makes it. `check_or_exit` prints that line as `<prog>: error: ...` and exits 2, before the target
is loaded. What each stage needs:

    eval       the drafter (eval.checkpoint, default RUN/export) and RUN/features
    bench      the drafter, unless SGLang servers already running serve it (bench.backend sglang
               without bench.sglang.launch); the bench.calibration (and calibration_pool) files when set
    economics  RUN/bench/summary.json, or with bench.calibration (a file) RUN/eval/accept_len.json
    report     something to report: train/metrics.jsonl, eval/accept_len.json or bench/summary.json

Economics and report check what they read, not RUN/export: they also serve folders that hold only a
benchmark's results (a bench run with eval.checkpoint elsewhere).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from eagle3ft.config import BenchConfig, Config, EvalConfig, resolve_path
from eagle3ft.run_dir import RunDir

DRAFTER_FILES = ("config.json", "model.safetensors")
STAGES = ("eval", "bench", "economics", "report")


def _cmd(parts: list[str]) -> str:
    return " ".join(shlex.quote(p) for p in parts)


def train_command(config: str, run_dir: Path) -> str:
    return _cmd(["eagle3ft", "train", "--config", str(config), "--run-dir", str(run_dir), "--resume", "auto"])


def stage_command(stage: str, config: str, run_dir: Path) -> str:
    """The one door of a stage: `eagle3ft STAGE --config CONFIG --run-dir RUN`."""
    return _cmd(["eagle3ft", stage, "--config", str(config), "--run-dir", str(run_dir)])


def _checkpoints(run_dir: Path) -> list[str]:
    found = [p.name for p in RunDir(run_dir).ckpt.glob("step-*") if re.fullmatch(r"step-\d+", p.name)]
    return sorted(found, key=lambda n: int(n.split("-")[1]))


def missing_drafter(checkpoint: Path, run_dir: Path, config: str) -> str | None:
    """The drafter folder must hold config.json and model.safetensors."""
    lacking = [f for f in DRAFTER_FILES if not (checkpoint / f).is_file()]
    if not lacking:
        return None
    what = (
        f"no drafter at {checkpoint}" if not checkpoint.exists() else f"{checkpoint} has no {' and no '.join(lacking)}"
    )
    if checkpoint != RunDir(run_dir).export:
        return f"{what} (eval.checkpoint): point --set eval.checkpoint=DIR at an exported drafter folder"
    ckpts = _checkpoints(run_dir)
    state = f"training stopped at ckpt/{ckpts[-1]} before the export; resume it" if ckpts else "train one"
    return f"{what}: {state}: {train_command(config, run_dir)}"


def check(stage: str, ev: EvalConfig, bench: BenchConfig, run_dir: Path, config: str) -> str | None:
    """None when `stage` has its inputs in `run_dir`, else one line naming what is missing and how to make it."""
    if stage not in STAGES:
        raise ValueError(f"preflight stage {stage!r}: expected one of {STAGES}")
    run_dir = Path(run_dir)
    drafter = lambda: missing_drafter(RunDir(run_dir).drafter(ev.checkpoint), run_dir, config)  # noqa: E731
    run = RunDir(run_dir)
    features, offline, summary, metrics = run.features_manifest, run.accept_len, run.bench_summary, run.metrics
    if stage == "eval":
        if not features.is_file():
            return f"no {features}: harvest first: {stage_command('harvest', config, run_dir)}"
        return drafter()
    calibrations = [("bench.calibration", bench.calibration)] if bench.calibration else []
    calibrations += [("bench.calibration_pool", p) for p in bench.calibration_pool]
    for key, path in calibrations:
        if stage in ("bench", "economics") and not resolve_path(path).is_file():
            return (
                f"no calibration file {resolve_path(path)} ({key}): every `eagle3ft bench` run writes "
                "RUN/bench/calibration.json"
            )
    if stage == "bench":  # running SGLang servers given by URL hold their drafter: nothing to check here
        return None if bench.backend == "sglang" and not bench.sglang.launch else drafter()
    if stage == "economics":
        if summary.is_file() or (bench.calibration and offline.is_file()):
            return None
        need, script = (offline, "eval") if bench.calibration else (summary, "bench")
        return drafter() or f"no {need}: run {stage_command(script, config, run_dir)}"
    if metrics.is_file() or offline.is_file() or summary.is_file():
        return None
    return (
        drafter()
        or f"nothing to report in {run_dir} (no {offline}, no {summary}): run {stage_command('eval', config, run_dir)}"
    )


def check_or_exit(prog: str, stage: str, cfg: Config, run_dir: Path, config: str) -> None:
    """Exit 2 with `<prog>: error: <what is missing>: <command>` when `stage` lacks an input."""
    problem = check(stage, cfg.eval, cfg.bench, run_dir, config)
    if problem:
        print(f"{prog}: error: {problem}", file=sys.stderr)
        raise SystemExit(2)
