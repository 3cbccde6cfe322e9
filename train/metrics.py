"""What a training step reports: start-up seconds, the sums between records, the metrics record and where it goes.

`SetupTimes` times setup's sections; `Meter` sums a step's per-depth counts until the next record;
`metrics_record` turns them into one record (a collective: every rank calls it); `log_record` appends it to
`train/metrics.jsonl`, sends it to wandb (`open_wandb`) and shows it on the progress bar (main process).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from eagle3ft.config import Config, to_dict
from eagle3ft.config_train import TrainConfig
from eagle3ft.files import disk_full, json_text

if TYPE_CHECKING:
    from eagle3ft.train.dist import Dist


class SetupTimes:
    """Seconds per start-up section, printed once: where a slow start goes."""

    def __init__(self, started: float) -> None:
        self.last, self.parts = started, {}

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.parts[name], self.last = now - self.last, now

    def __str__(self) -> str:
        return ", ".join(f"{k} {v:.1f} s" for k, v in self.parts.items())


def timestamp(cuda: bool) -> Any:
    """A point on the GPU's timeline (a recorded CUDA event) or on the host clock (seconds); `elapsed` subtracts two."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed(a: Any, b: Any) -> float:
    """Seconds from timestamp a to b (CUDA events: b must have completed)."""
    return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a


class PhaseClock:
    """Where a step's time goes: `mark(phase)` ends a phase (a CUDA event on the GPU, the host clock on the CPU);
    `take()` gives each phase's seconds per optimizer step since the last take (it syncs: call it when a record is
    made anyway). Phases: between (from the last step's end until the next micro-batch is on the device: the loader,
    the copy, online mode's target prefill, the records, and the GPU's idle time while the host gets there), forward,
    backward (with ZeRO's gradient reduction), optimizer (clipping, the update, ZeRO's parameter gather). `pause()`
    drops the span up to the next mark (held-out τ and checkpoints are no step's)."""

    PHASES = ("between", "forward", "backward", "optimizer")

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.last: Any = None  # the previous mark (None after a pause)
        self.spans: list[tuple[str, Any, Any]] = []
        self.steps = 0

    def mark(self, phase: str) -> None:
        now = timestamp(self.cuda)
        if self.last is not None:
            self.spans.append((phase, self.last, now))
        self.last = now

    def pause(self) -> None:
        self.last = None

    def step(self) -> None:
        self.steps += 1

    def take(self) -> dict[str, float]:
        if self.cuda and self.spans:
            self.spans[-1][2].synchronize()
        out = dict.fromkeys(self.PHASES, 0.0)
        for phase, a, b in self.spans:
            out[phase] += elapsed(a, b)
        steps, self.spans, self.steps = max(self.steps, 1), [], 0
        return {k: v / steps for k, v in out.items()}


class Meter:
    """Sums since the last log record: per-depth loss and accuracy counts (5, K), real tokens, micro-batches,
    seconds."""

    def __init__(self, ttt_steps: int, device: torch.device, summed: bool = False) -> None:
        """ttt_steps: the depth (a DFlash block's B - 1); summed: the loss is the plain sum of step_loss (a DFlash
        block's positions, each its weighted share), not the TTT unroll's step_decay**k sum."""
        self.stats = torch.zeros(5, ttt_steps, device=device)
        self.summed = summed
        self.tokens, self.micro, self.t0 = 0, 0, time.perf_counter()

    def add(self, out, tokens: int) -> None:
        self.stats += torch.stack([out.step_loss, out.correct, out.valid, out.chain_correct, out.chain_valid]).detach()
        self.tokens += tokens  # real tokens, padding excluded
        self.micro += 1

    def reset(self) -> None:
        self.stats.zero_()
        self.tokens, self.micro, self.t0 = 0, 0, time.perf_counter()


def metrics_record(
    meter: Meter, dist: Dist, tcfg: TrainConfig, step: int, epoch: int, lr: float, samples: list, started: float
) -> dict:
    """The metrics of the steps since the last record, summed over the processes (a collective: every rank calls it).

    `started` is when setup began (perf_counter): the record's elapsed_s counts start-up, held-out τ and saves."""
    K = meter.stats.shape[1]
    s = dist.reduce_sum(meter.stats)
    n_tok = int(dist.reduce_sum(torch.tensor(float(meter.tokens), device=dist.device)))
    n_micro = int(dist.reduce_sum(torch.tensor(float(meter.micro), device=dist.device)))
    dt = time.perf_counter() - meter.t0
    acc = (s[1] / s[2].clamp(min=1)).tolist()
    cond = (s[3] / s[4].clamp(min=1)).tolist()
    step_loss = (s[0] / max(n_micro, 1)).tolist()
    return {
        "step": step,
        "epoch": epoch,
        "loss": sum((1.0 if meter.summed else tcfg.objective.step_decay**k) * step_loss[k] for k in range(K)),
        "step_loss": step_loss,
        "acc": acc,
        "cond_acc": cond,
        "accept_len_est": 1 + sum(math.prod(cond[: k + 1]) for k in range(K)),
        "lr": lr,
        "samples": samples,
        "tokens": n_tok,
        "tokens_per_s": n_tok / dt,
        "s_per_step": dt / tcfg.logging.log_every,
        "max_mem_gib": torch.cuda.max_memory_allocated(dist.device) / 2**30 if dist.device.type == "cuda" else None,
        "elapsed_s": time.perf_counter() - started,  # since setup began: start-up, held-out τ and saves included
    }


DIVERGED = 100.0  # a logged loss this many times the run's first logged loss: the training is diverging


def diverged(loss: float, first: float | None) -> bool:
    """True when `loss` has risen DIVERGED times above the run's first logged loss `first` (when that is positive),
    or is not finite."""
    if not math.isfinite(loss):
        return True
    return first is not None and math.isfinite(first) and first > 0 and loss > DIVERGED * first


def divergence(records: list[dict]) -> dict | None:
    """The first training record (train/metrics.jsonl, in step order) whose loss diverged from the first record's:
    {step, loss, first_step, first_loss, ratio}; None when none did."""
    losses = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    if not losses:
        return None
    (first_step, first), *_ = losses
    for step, loss in losses[1:]:
        if diverged(loss, first):
            ratio = loss / first if math.isfinite(loss) else None
            return {"step": step, "loss": loss, "first_step": first_step, "first_loss": first, "ratio": ratio}
    return None


def open_wandb(cfg: Config, log_dir: Path) -> Any:
    """Main process: the run's wandb run (train.wandb_mode, train.wandb_project), None when disabled."""
    tcfg = cfg.train
    if tcfg.logging.wandb_mode == "disabled":
        return None
    import wandb

    return wandb.init(
        project=tcfg.logging.wandb_project,
        name=cfg.run_name,
        mode=tcfg.logging.wandb_mode,
        dir=str(log_dir),
        config=to_dict(cfg),
        resume="allow",
    )


def log_record(record: dict, metrics_file: Path, wandb_run: Any, bar: tqdm) -> None:
    """Main process: append the record to metrics.jsonl, send it to wandb, show it on the progress bar."""
    line = json_text(record, str(metrics_file)) + "\n"
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)  # never through a link
    with (
        disk_full(metrics_file),
        open(os.open(metrics_file, flags, 0o666), "a") as f,
    ):  # a cut line is dropped on resume
        f.write(line)
    if wandb_run is not None:
        flat = {k: v for k, v in record.items() if not isinstance(v, list)}
        flat.update(
            {
                f"{name}/{k}": x
                for name in ("step_loss", "acc", "cond_acc", "heldout_cond_acc")
                if name in record
                for k, x in enumerate(record[name])
            }
        )
        wandb_run.log(flat, step=record["step"])
    bar.set_postfix(loss=f"{record['loss']:.3f}", acc0=f"{record['acc'][0]:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
