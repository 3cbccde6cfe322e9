"""The run's state (`Run`) as setup builds it and fit advances it, its LR schedule, and its restore on a resume."""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3ft.config import Config, to_dict
from eagle3ft.config_train import MISSING, TrainConfig, written_value
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.run_dir import RunDir
from eagle3ft.train.checkpoint import (
    CheckpointError,
    checkpoints,
    choose_resume,
    load_checkpoint,
    read_trainer_state,
    resume_position,
)
from eagle3ft.train.data import TrainData
from eagle3ft.train.l2sp import L2SP, SelfSetLambda
from eagle3ft.train.metrics import diverged
from eagle3ft.train.validate import HeldoutTracker

if TYPE_CHECKING:
    from eagle3ft.train.dist import Dist


# --------------------------------------------------------------------------- the LR schedule


def lr_lambda(tcfg: TrainConfig, total: int):
    """Linear warm-up, then cosine down to min_lr_ratio at `total` steps."""

    def f(step: int) -> float:
        if step < tcfg.schedule.warmup_steps:
            return (step + 1) / tcfg.schedule.warmup_steps
        frac = min(1.0, (step - tcfg.schedule.warmup_steps) / max(1, total - tcfg.schedule.warmup_steps))
        return tcfg.schedule.min_lr_ratio + (1 - tcfg.schedule.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))

    return f


# --------------------------------------------------------------------------- the run


@dataclass
class Run:
    """What setup builds and fit advances: the run's pieces and where it is (the one `state` litgpt's fit carries)."""

    cfg: Config
    run_dir: Path
    dist: Dist
    data: TrainData
    model: Eagle3Drafter
    engine: Any  # the TTT objective as dist.prepare wrapped it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    total: int  # optimizer steps of the whole run
    lock: Any  # the run folder's lock (dist.lock_run), released at the end
    heldout: HeldoutTracker | None = None
    l2sp: L2SP | None = None  # train.l2sp's penalty on this rank's master partitions
    self_set: SelfSetLambda | None = None  # train.l2sp auto: the calibration window, then its record
    w0_fingerprint: float | None = None  # Σ w0² over every rank (train/l2sp.py), recorded in each checkpoint
    identity: dict = field(default_factory=dict)  # the training data's and the vocab's (data_identity), in each one
    wandb_run: Any = None
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches of this epoch this process has consumed
    start_step: int = 0  # the step this process started (or resumed) at
    last: dict = field(default_factory=dict)  # the last metrics record
    first_loss: float | None = None  # the run's first logged loss (a resume keeps its checkpoint's)
    warned: bool = False  # the divergence warning was given
    started: float = field(default_factory=time.perf_counter)  # when setup began (the records' elapsed_s)
    kind: str = "eagle3"  # the drafter kind (eagle3ft/drafter/folder.py's family): eagle3 or dflash

    def lr_at(self, step: int) -> float:
        """The schedule's factor on train.lr at 0-based optimizer step `step`."""
        return lr_lambda(self.cfg.train, self.total)(step)

    @property
    def metrics_file(self) -> Path:
        return RunDir(self.run_dir).metrics

    def trainer_state(self) -> dict:
        """What a checkpoint records besides the weights: the step, the data position, the config, the last metrics."""
        tcfg = self.cfg.train
        n_order = self.data.order_len(self.epoch)  # samples, or bins when packed
        consumed = min(
            n_order, self.batch_in_epoch * self.dist.world * self.data.per_micro_batch
        )  # of the epoch's seeded order
        return {
            "step": self.step,
            "data": {"epoch": self.epoch, "samples_in_epoch": consumed, "n_train": n_order},
            "world_size": self.dist.world,
            "micro_batch_size": tcfg.batch.micro_batch_size,
            "grad_accum": tcfg.batch.grad_accum,
            "total_steps": self.total,
            "config": to_dict(self.cfg),
            "last": self.last,
            "first_loss": self.first_loss,
            "data_identity": self.identity,
            **(
                {
                    "l2sp": {
                        "lambda": self.l2sp.lam,
                        "w0_sq": self.w0_fingerprint,
                        **({"auto": self.self_set.record} if self.self_set is not None else {}),
                    }
                }
                if self.l2sp is not None
                else {}
            ),
        }

    def last_good(self) -> Path | None:
        """The newest checkpoint whose last logged loss had not diverged from the run's first (checkpoints hold finite
        weights only: eagle3ft/drafter/export.py's write_drafter refuses others)."""
        for ckpt in reversed(checkpoints(self.run_dir)):
            try:
                loss = (read_trainer_state(ckpt).get("last") or {}).get("loss")
            except CheckpointError:
                continue
            if not isinstance(loss, (int, float)) or not diverged(loss, self.first_loss):
                return ckpt
        return None

    def resume_hint(self) -> str:
        ckpt = self.last_good()
        if ckpt is None:
            return "no checkpoint before it to resume from: start over with --overwrite and a lower train.lr"
        return f"the last good checkpoint is {ckpt}: resume from it with --resume {ckpt} and a lower train.lr"


# --------------------------------------------------------------------------- the resume


# train.* keys that a checkpoint's optimizer and scheduler state also hold, or that shape the LR schedule and the
# batch: on a resume this invocation's values run from the next step (apply_rates), and resume() names each that
# differs from the checkpoint's
RESUME_APPLIES = (
    "optimizer.lr",
    "optimizer.weight_decay",
    "optimizer.max_grad_norm",  # the clip DeepSpeed applies from the next step
    "schedule.warmup_steps",
    "schedule.min_lr_ratio",
    "schedule.max_steps",
    "schedule.epochs",
    "batch.micro_batch_size",
    "batch.grad_accum",
    "objective.l2sp",  # λ of the pull toward the weights the run started from (w0 is checked: check_w0)
    "objective.step_decay",  # the unroll steps' loss weights
    "objective.lk_eta",
)
# train.* keys that change what the loss is (its kind, the unroll it sums over): a resume under another value is
# refused, so that metrics.jsonl never logs two losses under one name; a warm start from the checkpoint in a new
# --run-dir (drafter.init) trains it under the new one
RESUME_REFUSES = ("objective.loss", "objective.ttt_steps", "objective.target_source")


def apply_rates(run: Run) -> None:
    """After a checkpoint's optimizer and scheduler state are loaded (they hold the rate and weight decay it ran
    with): this config's train.lr and train.weight_decay, and its schedule's rate for the next step."""
    tcfg, sched = run.cfg.train, run.scheduler.scheduler  # the LambdaLR inside accelerate's wrapper
    factor = lr_lambda(tcfg, run.total)(sched.last_epoch)  # last_epoch: optimizer steps taken
    sched.base_lrs = [tcfg.optimizer.lr for _ in sched.base_lrs]
    for group in sched.optimizer.param_groups:
        group.update(
            initial_lr=tcfg.optimizer.lr, lr=tcfg.optimizer.lr * factor, weight_decay=tcfg.optimizer.weight_decay
        )
    sched._last_lr = [group["lr"] for group in sched.optimizer.param_groups]


def resume(run: Run) -> dict | None:
    """Load train.resume's checkpoint (if any) into the prepared engine and move `run` to its step and data position;
    this config's rates, schedule and batch apply from the next step. Returns where it resumed (the checkpoint, its
    step, the train.* values that differ from the checkpoint's as [checkpoint's, now]), or None."""
    ckpt, refused = choose_resume(run.run_dir, run.cfg.train.checkpoint.resume)
    for why in refused:
        run.dist.print(f"--resume auto: passed over a damaged checkpoint: {why}")
    if ckpt is None and run.cfg.train.checkpoint.resume == "auto":
        run.dist.print(f"--resume auto: no checkpoint in {RunDir(run.run_dir).ckpt}; starting at step 0")
    if ckpt is not None:
        st, rng_note = load_checkpoint(run.dist, ckpt, run.cfg.seed, verify=run.cfg.train.checkpoint.resume != "auto")
        check_objective(run, st, ckpt)
        check_w0(run, st, ckpt)
        if run.self_set is not None and (
            note := run.self_set.restore((st.get("l2sp") or {}).get("auto"), run.l2sp, st["step"])
        ):
            run.dist.print(note)
        check_identity(run, st, ckpt)
        run.step, run.first_loss = st["step"], st.get("first_loss")
        run.epoch, run.batch_in_epoch = resume_position(
            st,
            ckpt,
            run.data.order_len(st.get("data", {}).get("epoch", 0)),
            run.data.per_micro_batch,
            run.dist.world,
            order_entries(run.data),
        )
        run.dist.print(
            f"resumed from {ckpt} at step {run.step} (epoch {run.epoch}, {st['data']['samples_in_epoch']} samples "
            f"of its order consumed; written by {st['world_size']} process(es), now {run.dist.world}; {rng_note})"
        )
        if st["total_steps"] != run.total:
            run.dist.print(
                f"note: {run.total} optimizer steps now, {st['total_steps']} when the checkpoint was written "
                "(set train.max_steps to keep the LR schedule)"
            )
    run.start_step = run.step
    if ckpt is None:
        return None
    apply_rates(run)
    before, now = (st.get("config") or {}).get("train") or {}, to_dict(run.cfg.train)
    changed = {}
    for key in RESUME_APPLIES:
        old, new = written_value(before, key), written_value(now, key)
        if old is not MISSING and old != new:
            changed[f"train.{key}"] = [old, new]
    if changed:
        what = ", ".join(f"{k} {new!r} (the checkpoint ran {old!r})" for k, (old, new) in changed.items())
        run.dist.print(f"resume: this config's {what} apply from step {run.step + 1}")
    return {"from": str(ckpt), "step": run.step, "changed": changed}


def order_entries(data: TrainData) -> str | None:
    """What an epoch's order of `data` holds when it is not one entry per training sample (None when it is)."""
    held = []
    if data.weights is not None:
        held.append(f"draws of its {len(data)} training samples by harvest.sources' weights")
    if data.lengths is not None:
        held.append(f"packed into bins of train.pack_tokens {data.cfg.train.batch.pack_tokens}")
    return ", ".join(held) or None


def check_objective(run: Run, st: dict, ckpt: Path) -> None:
    """CheckpointError naming each RESUME_REFUSES key this config changes from the checkpoint's."""
    before, now = (st.get("config") or {}).get("train") or {}, to_dict(run.cfg.train)
    changed = []
    for key in RESUME_REFUSES:
        old, new = written_value(before, key), written_value(now, key)
        if old is not MISSING and old != new:
            changed.append(f"train.{key} {new!r} (it ran {old!r})")
    if changed:
        raise CheckpointError(
            f"{ckpt}: this config's {', '.join(changed)} would change what the loss is in the middle of the run, "
            f"so it is not resumed: resume with the checkpoint's values, or warm-start a new --run-dir from it "
            f"(--set drafter.init={ckpt})"
        )


def data_identity(data: TrainData, d2t: torch.Tensor | None) -> dict:
    """What a checkpoint's weights were trained on: the training shards (TrainData.fingerprint) and the sha256 of the
    draft vocabulary's d2t, which each lm_head row follows (None for a drafter without one: DFlash drafts through
    the target's own head)."""
    return {
        "train_shards": data.fingerprint,
        "d2t_sha256": None if d2t is None else hashlib.sha256(d2t.cpu().to(torch.int64).numpy()).hexdigest(),
    }


def check_identity(run: Run, st: dict, ckpt: Path) -> None:
    """A resume continues weights on the data and vocabulary they were trained on: CheckpointError, naming the
    checkpoint and what changed, when the features were re-harvested since or its d2t is not this run's (a checkpoint
    written before the identity was recorded is checked by its own d2t alone)."""
    from safetensors import safe_open

    from eagle3ft.drafter.export import WEIGHTS

    d2t = run.model.d2t.cpu().to(torch.int64) if getattr(run.model, "d2t", None) is not None else None
    try:
        with safe_open(str(ckpt / WEIGHTS), framework="pt") as f:
            theirs = f.get_tensor("d2t").to(torch.int64) if "d2t" in f.keys() else None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{ckpt / WEIGHTS}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
    changed = []
    if theirs is not None and d2t is not None and (theirs.shape != d2t.shape or not torch.equal(theirs, d2t)):
        n = int((theirs != d2t).sum()) if theirs.shape == d2t.shape else max(d2t.numel(), theirs.numel())
        changed.append(
            f"{n} of {d2t.numel()} draft ids of its d2t map to other target tokens than {RunDir(run.run_dir).vocab}'s"
        )
    saved = st.get("data_identity") or {}
    if saved.get("train_shards") not in (None, run.identity["train_shards"]):
        changed.append(f"the training shards of {run.data.where} are not those it was trained on")
    if changed:
        raise CheckpointError(
            f"{ckpt}: written for other data than this run now has ({'; '.join(changed)}: re-harvested since?); its "
            "weights follow the old vocabulary, so it is not resumed: start over with --overwrite"
        )


def check_w0(run: Run, st: dict, ckpt: Path) -> None:
    """L2-SP's w0 built for this resume must be the one the checkpoint's run pulled toward (the same drafter.init
    and seed): CheckpointError naming both otherwise."""
    saved = (st.get("l2sp") or {}).get("w0_sq")
    if run.l2sp is None or saved is None or math.isclose(saved, run.w0_fingerprint, rel_tol=1e-9):
        return
    raise CheckpointError(
        f"{ckpt}: train.l2sp pulls toward the starting weights, but those built now (Σw0² {run.w0_fingerprint!r}) are "
        f"not the ones this checkpoint's run started from (Σw0² {saved!r}): drafter.init or the seed changed"
    )
