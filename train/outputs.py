"""A run folder's training outputs, so that a training run is never silently restarted over an earlier one, and
`--overwrite` removes nothing else.

A folder is a run by its own markers only (`run_markers`): the config.yaml record that every stage writes
(eagle3ft/cli.py's save_resolved), its feature store's manifest.json, or a checkpoint the trainer wrote
(ckpt/step-N/trainer_state.json). A folder's names say nothing: a user's `train/` or `export/`, or a checkout's
`train/` package, are no training outputs.

What training writes (`training_outputs`): ckpt/step-N/ (through ckpt/.step-N.tmp), export/ and export-best/ (each
with the card.json train/validate.py writes, through .<name>.tmp and .<name>.old), and train/'s metrics.jsonl,
data.json and wandb/. A run holding any of them has started: train/finetune.py continues it (`--resume auto`) or
removes exactly those first (`--overwrite`), and refuses otherwise, so a folder never mixes the checkpoints and exports
of two runs. `--overwrite` refuses a folder that is no run. An export/ or export-best/ without the trainer's card (a
drafter the user put there) is refused in every mode: training would replace it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import yaml

from eagle3ft.run_dir import RunDir
from eagle3ft.train.checkpoint import TRAINER_STATE, step_dirs
from eagle3ft.train.validate import CARD

TRAIN_LOGS = ("metrics.jsonl", "data.json", "wandb", "l2sp.json", "guard.json")  # what training writes into RUN/train
CARD_KINDS = ("last", "best", "guarded")  # card.json's "which" in RUN/export and RUN/export-best


def _json_object(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def has_stage_record(config: Path) -> bool:
    """True when `config` is a config.yaml that eagle3ft/cli.py's save_resolved wrote: a `stages` mapping of records
    that each hold a `config`."""
    try:
        doc = yaml.safe_load(config.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False
    stages = doc.get("stages") if isinstance(doc, dict) else None
    return (
        isinstance(stages, dict)
        and bool(stages)
        and all(isinstance(s, dict) and "config" in s for s in stages.values())
    )


def _trainer_checkpoint(folder: Path) -> bool:
    """A ckpt/step-N folder whose trainer_state.json the trainer wrote (a JSON object with its step)."""
    state = _json_object(folder / TRAINER_STATE)
    return state is not None and isinstance(state.get("step"), int)


def run_markers(run_dir: Path) -> list[str]:
    """What makes run_dir a run (names relative to it): its stage record, its feature store, the trainer's
    checkpoints. Empty for any other folder."""
    run = RunDir(run_dir)
    found = ["config.yaml"] if run.config.is_file() and has_stage_record(run.config) else []
    if run.features_manifest.is_file():
        found.append("features/manifest.json")
    return found + [f"ckpt/{p.name}" for p in step_dirs(run_dir) if _trainer_checkpoint(p)]


def _export(folder: Path) -> bool:
    """An export the trainer wrote: a folder with its card.json ("which": last or best)."""
    card = _json_object(folder / CARD) if folder.is_dir() and not folder.is_symlink() else None
    return card is not None and card.get("which") in CARD_KINDS


def training_outputs(run_dir: Path) -> list[str]:
    """The trainer's outputs present in run_dir (paths relative to it), temporary siblings included; nothing when
    run_dir is no run."""
    run = RunDir(run_dir)
    if not run_markers(run_dir):
        return []
    found = [f"ckpt/{p.name}" for p in step_dirs(run_dir) if _trainer_checkpoint(p)]
    if run.ckpt.is_dir() and not run.ckpt.is_symlink():
        temporary = re.compile(r"\.step-\d+\.tmp")  # train/checkpoint.py's save_checkpoint, killed mid-way
        found += sorted(f"ckpt/{p.name}" for p in run.ckpt.iterdir() if temporary.fullmatch(p.name) and p.is_dir())
    for final in (run.export, run.export_best):  # eagle3ft/drafter/export.py's atomic_dir and its siblings
        siblings = [final.with_name(f".{final.name}.{tail}") for tail in ("tmp", "old")]
        found += [p.name for p in (final, *siblings) if _export(p) or (p in siblings and p.is_dir())]
    if run.train.is_dir() and not run.train.is_symlink():
        found += [f"train/{n}" for n in TRAIN_LOGS if (run.train / n).exists() or (run.train / n).is_symlink()]
    return found


def refusal(run_dir: Path, found: list[str]) -> str:
    """What to say to a launch without --resume on a run whose training has started."""
    return (
        f"{run_dir} already holds a training run ({', '.join(found)}); continue it with --resume auto, or start over "
        "in a new --run-dir or with --overwrite (removes those first)"
    )


def not_a_run(run_dir: Path) -> str:
    """What to say to --overwrite on a folder that is no run."""
    return (
        f"--overwrite: {run_dir} is not a run folder (no config.yaml of a stage, no features/manifest.json, no "
        "ckpt/step-N of the trainer), so nothing in it is removed; give the folder a harvest wrote to"
    )


def remove_training_outputs(run_dir: Path) -> list[str]:
    """Delete the trainer's outputs of run_dir (the caller holds its lock), then ckpt/ and train/ when nothing else is
    left in them; returns what was removed. Anything else in the folder stays."""
    found = training_outputs(run_dir)
    for name in found:
        path = Path(run_dir) / name
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    run = RunDir(run_dir)
    for folder in (run.ckpt, run.train):
        if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
            folder.rmdir()
    return found


def stale_derived(run_dir: Path) -> list[str]:
    """The later stages' outputs that describe the drafter of an earlier run."""
    return [p.name for p in RunDir(run_dir).derived if p.exists()]


def foreign_export(run_dir: Path) -> str | None:
    """What to say when RUN/export or RUN/export-best holds something the trainer did not write (a user's drafter
    copied there for eval, a file, a link): training replaces both, so it does not start; None otherwise."""
    run = RunDir(run_dir)
    for final in (run.export, run.export_best):
        if (final.exists() or final.is_symlink()) and not _export(final):
            return (
                f"{final} is not an export this trainer wrote (no card.json of it), and training writes its drafter "
                "there: move it elsewhere first (--overwrite removes only the trainer's outputs, not this)"
            )
    return None


def start_refusal(run_dir: Path, resume: str | None, overwrite: bool) -> str | None:
    """Why training may not start in `run_dir` (None: it may): a started run folder needs --resume or --overwrite,
    --overwrite needs a run folder, and RUN/export and RUN/export-best must be the trainer's or absent."""
    if overwrite and resume is not None:
        return "--overwrite starts over, --resume (train.resume) continues: give one of them"
    if overwrite and not run_markers(run_dir):
        return not_a_run(run_dir)
    if foreign := foreign_export(run_dir):
        return foreign
    metrics = RunDir(run_dir).metrics
    if metrics.is_symlink() and not overwrite:  # --overwrite removes the link itself (remove_training_outputs)
        return (
            f"{metrics} is a link (to {os.readlink(metrics)}): the trainer appends its metrics there and would write "
            "through it; put the file itself there, or remove the link"
        )
    if not overwrite and resume is None and (found := training_outputs(run_dir)):
        return refusal(run_dir, found)
    return None


def start_over(run_dir: Path) -> None:
    """--overwrite, under the run lock, once the run's checks have passed: the old run's training outputs go before
    anything is written, one stderr line each for what was removed and what now describes the old drafter."""
    if removed := remove_training_outputs(run_dir):
        print(f"--overwrite: removed {', '.join(removed)} of {run_dir}", file=sys.stderr, flush=True)
    if stale := stale_derived(run_dir):
        print(
            f"note: {', '.join(f'{run_dir}/{n}' for n in stale)} describe the old run's drafter; rerun those stages",
            file=sys.stderr,
            flush=True,
        )
