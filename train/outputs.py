"""A run folder's training outputs, so that a training run is never silently restarted over an earlier one.

Training writes `ckpt/`, `export/`, `export-best/` (each written through a `.<name>.tmp` sibling) and `train/`
(metrics.jsonl, data.json, wandb). A folder holding any of them belongs to a run that has started: train/finetune.py
continues it (`--resume auto`), or removes them all first (`--overwrite`), and refuses otherwise, so a folder never
mixes the checkpoints and exports of two runs.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from eagle3ft.run_dir import RunDir


def training_outputs(run_dir: Path) -> list[str]:
    """The training outputs present in run_dir (names relative to it), temporary siblings included."""
    run = RunDir(run_dir)
    exports = (run.export.name, run.export_best.name)
    names = [*(p.name for p in run.training_outputs), *(f".{n}.{tail}" for n in exports for tail in ("tmp", "old"))]
    return [n for n in names if (run.root / n).exists()]


def refusal(run_dir: Path, found: list[str]) -> str:
    """What to say to a launch without --resume on a folder whose training has started."""
    outputs = ", ".join(f"{p.name}/" for p in RunDir(run_dir).training_outputs)
    return (
        f"{run_dir} already holds a training run ({', '.join(found)}); continue it with --resume auto, or start over "
        f"in a new --run-dir or with --overwrite (removes {outputs} first)"
    )


def remove_training_outputs(run_dir: Path) -> list[str]:
    """Delete every training output of run_dir (the caller holds its lock); returns what was removed."""
    found = training_outputs(run_dir)
    for name in found:
        path = Path(run_dir) / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    return found


def stale_derived(run_dir: Path) -> list[str]:
    """The later stages' outputs that describe the drafter of an earlier run."""
    return [p.name for p in RunDir(run_dir).derived if p.exists()]
