"""Resumable training checkpoints: a drafter in SGLang's form (eagle3ft/drafter/export.py) plus the state to resume.

A training checkpoint `ckpt/step-N/` is the drafter folder plus the state to resume, in files that hold data only
(safetensors and JSON: loading one runs no code) and that do not depend on the number of processes:
  state.safetensors   fp32.<param>, exp_avg.<param>, exp_avg_sq.<param>: the whole fp32 master weight
                      and Adam moments of every trainable parameter; rank<r>.torch_cpu (uint8),
                      rank<r>.torch_cuda (uint8, on CUDA), rank<r>.numpy_keys: each rank's RNG states
  state.json          optimizer (class, step count, hyper-parameters per group, parameter names),
                      LR scheduler state, engine counters, the Python/NumPy RNG scalars per rank
  trainer_state.json  format, step, data position (epoch, samples of its seeded order consumed),
                      world size, batch shape, total steps, resolved config, last metrics, the identity of the data
                      and vocabulary it was trained on (data_identity: the training shards' and d2t's sha256, which a
                      resume checks, train/run_state.py), and the sha256 of every other file of the folder; written
                      last
Folders are written under a temporary name and renamed, so a reader never sees half a checkpoint; a resume checks
every file against its sha256 (a checkpoint written before the checksums is checked for whole files only).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.folder import write_folder
from eagle3ft.files import as_umask_allows, disk_full, json_text, sha256_file
from eagle3ft.run_dir import RunDir

TRAINER_STATE, STATE_TENSORS, STATE_JSON = "trainer_state.json", "state.safetensors", "state.json"
FORMAT = "eagle3ft-train-state-2"


def step_dirs(run_dir: Path) -> list[Path]:
    """Every ckpt/step-N folder, oldest first."""
    found = [p for p in RunDir(run_dir).ckpt.glob("step-*") if re.fullmatch(r"step-\d+", p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete ckpt/step-N folders (trainer_state.json is written last), oldest first."""
    return [p for p in step_dirs(run_dir) if (p / TRAINER_STATE).is_file()]


def resume_path(run_dir: Path, resume: str | None) -> Path | None:
    """None, the newest checkpoint for 'auto' (None when there is none), or the named folder."""
    if resume is None:
        return None
    if resume == "auto":
        found = checkpoints(run_dir)
        return found[-1] if found else None
    p = Path(resume)
    if not (p / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"train.resume: {p} is not a checkpoint (no {TRAINER_STATE})")
    return p


class CheckpointError(ValueError):
    """A checkpoint file is missing, damaged or of another kind; the message names the file."""


def verify_checkpoint(path: Path) -> dict:
    """The checkpoint's trainer state; CheckpointError naming the file unless the files a resume reads are whole:
    trainer_state.json (of this format), state.json, state.safetensors (its header read, and the file as long as the
    header says), and every file trainer_state.json lists matching its sha256 (what a whole file can still hide)."""
    st = read_trainer_state(path)
    read_json(Path(path) / STATE_JSON)
    StateTensors(Path(path) / STATE_TENSORS)
    sums = st.get("sha256", {})
    if not isinstance(sums, dict):
        raise CheckpointError(f"{Path(path) / TRAINER_STATE}: sha256 is not a mapping of file names")
    for name, digest in sums.items():
        f = Path(path) / name
        if Path(name).name != name or not f.is_file():
            raise CheckpointError(f"{f}: missing")
        if sha256_file(f) != digest:
            raise CheckpointError(f"{f}: fails its sha256 check (damaged after it was written)")
    return st


def choose_resume(run_dir: Path, resume: str | None) -> tuple[Path | None, list[str]]:
    """(the checkpoint to resume from, why each newer one was passed over). A named folder is taken as it is (its
    damage is an error when it loads); 'auto' takes the newest that verifies (verify_checkpoint: whole files, each
    matching its sha256) and passes over the damaged ones, and is a CheckpointError when there are checkpoints but
    none verifies (None when there is none: a fresh start)."""
    if resume != "auto":
        return resume_path(run_dir, resume), []
    refused = []
    for ckpt in reversed(step_dirs(run_dir)):
        try:
            verify_checkpoint(ckpt)
            return ckpt, refused
        except CheckpointError as e:
            refused.append(str(e))
    if refused:
        raise CheckpointError(
            f"--resume auto: no checkpoint in {RunDir(run_dir).ckpt} verifies ({'; '.join(refused)}); start over "
            "with --overwrite"
        )
    return None, []


def read_json(path: Path) -> dict:
    """A JSON object from `path`; CheckpointError naming the file otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


class StateTensors:
    """The tensors of a state.safetensors, read one at a time (safetensors: no code runs)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._f = safe_open(str(self.path), framework="pt")
            self._keys = set(self._f.keys())
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: missing") from None
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{self.path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._f.get_slice(key).get_shape())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise CheckpointError(f"{self.path}: no tensor {key}")
        try:
            return self._f.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{self.path}: cannot read {key} ({str(e).splitlines()[0]})") from None


def save_checkpoint(dist, module, cfg: DrafterConfig, run_dir: Path, step: int, trainer_state: dict, keep: int) -> Path:
    """Collective: every rank calls it. Writes ckpt/step-N atomically (from the main process) and keeps the newest
    `keep`."""
    root = RunDir(run_dir).ckpt
    final = root / f"step-{step}"
    tensors, meta = dist.training_state()
    state = dist.full_state_dict(module)
    if dist.is_main:
        tmp = root / f".step-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            write_folder(tmp, cfg, state, prefix="drafter.")
            with disk_full(tmp / STATE_TENSORS):
                save_file(tensors, str(tmp / STATE_TENSORS), metadata={"format": FORMAT})
            as_umask_allows(tmp / STATE_TENSORS)
            with disk_full(tmp / STATE_JSON):
                (tmp / STATE_JSON).write_text(json_text(meta, str(tmp / STATE_JSON), indent=1) + "\n")
            sums = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}
            record = {"format": FORMAT, **trainer_state, "sha256": sums}
            with disk_full(tmp / TRAINER_STATE):
                (tmp / TRAINER_STATE).write_text(json_text(record, str(tmp / TRAINER_STATE), indent=1) + "\n")
        except BaseException:  # non-finite weights, a full disk, a kill: no half checkpoint is left
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    dist.barrier()
    return final


def read_trainer_state(path: Path) -> dict:
    """A checkpoint's trainer_state.json, refusing the older DeepSpeed form (pickled state/ files)."""
    st = read_json(Path(path) / TRAINER_STATE)
    if st.get("format") != FORMAT:
        raise CheckpointError(
            f"{Path(path) / TRAINER_STATE}: format {st.get('format')!r}, expected {FORMAT!r} (an older checkpoint "
            "keeps its "
            "training state in pickles, which are not loaded; start from its weights instead: --set "
            f"drafter.init={path})"
        )
    return st


def load_checkpoint(dist, path: Path, seed: int, verify: bool = True) -> tuple[dict, str]:
    """Restore optimizer, scheduler, engine counters and RNG from `path` (collective); returns (trainer_state, RNG
    note).

    Reads only trainer_state.json, state.json and state.safetensors, each file checked against its sha256 first
    (verify=False: choose_resume has just done it); every problem is a CheckpointError naming the file.
    """
    path = Path(path)
    st = verify_checkpoint(path) if verify else read_trainer_state(path)
    meta = read_json(path / STATE_JSON)
    tensors = StateTensors(path / STATE_TENSORS)
    try:
        opt = meta["optimizer"]
        shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in dist.trainable()}
        if list(shapes) != opt["params"]:
            raise CheckpointError(
                f"{path / STATE_JSON}: trainable parameters {opt['params']} differ from the drafter's {list(shapes)}"
            )
        for name, shape in shapes.items():
            for k in ("fp32", *opt["moments"]):
                key = f"{k}.{name}"
                if key not in tensors:
                    raise CheckpointError(f"{tensors.path}: no tensor {key}")
                if tensors.shape(key) != shape:
                    raise CheckpointError(
                        f"{tensors.path}: {key} has shape {list(tensors.shape(key))}, the drafter's is {list(shape)}"
                    )
        note = dist.load_training_state(tensors, meta, seed)
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{path / STATE_JSON}: missing or malformed entry {e}") from None
    return st, note


def resume_position(
    st: dict, path: Path, n_train: int, micro_batch_size: int, world: int, entries: str | None = None
) -> tuple[int, int]:
    """(epoch, micro-batches per rank to skip) to continue the seeded global sample order where `st` left it.

    The position is stored as samples consumed (`entries`: what the order holds instead, when it is not the samples
    themselves: draws by the sources' weights, packed bins); on W processes of micro batch B, rank r reads global
    micro-batches r, r+W, ... of the epoch's order, so the position must split into rounds of W x B.
    """
    data = st.get("data")
    if not isinstance(data, dict) or not {"epoch", "samples_in_epoch", "n_train"} <= set(data):
        raise CheckpointError(
            f"{Path(path) / TRAINER_STATE}: no data position (data.epoch, data.samples_in_epoch, data.n_train)"
        )
    if data["n_train"] != n_train and entries is None:
        raise CheckpointError(
            f"{Path(path) / TRAINER_STATE}: written for {data['n_train']} training samples, the store has {n_train}"
        )
    if data["n_train"] != n_train:  # the epoch's order is of draws by the sources' weights, or of packed bins
        raise CheckpointError(
            f"{Path(path) / TRAINER_STATE}: written for an epoch of {data['n_train']} entries, this run's has "
            f"{n_train} ({entries}); resume with the checkpoint's store and settings, or start over with --overwrite"
        )
    epoch, done = data["epoch"], data["samples_in_epoch"]
    if done >= n_train:
        return epoch + 1, 0
    per_round = world * micro_batch_size
    if done % per_round:
        raise CheckpointError(
            f"{Path(path) / TRAINER_STATE}: {done} samples of epoch {epoch} consumed do not split into rounds of "
            f"{per_round} "
            f"({world} process(es) x train.micro_batch_size {micro_batch_size}); resume with processes x micro batch "
            f"dividing {done}"
        )
    return epoch, done // per_round


def truncate_metrics(path: Path, step: int) -> int:
    """Drop the records of `path` (metrics.jsonl) past `step`, in one rename; returns how many were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a line cut short by a kill
    if len(keep) == len(lines):
        return 0
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)  # a killed run's, or a link: replaced, never written through
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return len(lines) - len(keep)
