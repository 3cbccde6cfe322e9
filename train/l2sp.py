"""L2-SP: a pull toward the weights the run started from (train.l2sp), so a fine-tune keeps what the drafter knew.

The penalty is λ·Σ‖w − w0‖² over every trained tensor, w0 the weights before the first step (a warm start's, or a
scratch run's seeded init). Its gradient 2λ(w − w0) is added in a step pre-hook of the optimizer that DeepSpeed
steps, to each fp32 master partition that optimizer updates: ZeRO 1/2 give each rank one flat partition per group,
ZeRO-3 its sub-group partitions (train/dist.py `master_partitions`). So each rank keeps w0 for its own partition
alone, in the masters' precision, and nothing is gathered. The gradients a rank steps are already averaged over
the ranks, and each element has one owner, so the step is the one of (mean loss + penalty).

DeepSpeed clips before it steps the optimizer: the clip bounds the data's gradient, never the pull toward the start
(with train.max_grad_norm 0 the step is exactly that of the penalised loss).

On resume w0 is built again as it was first built (drafter.init, the seed), before the checkpoint's weights are
loaded; `fingerprint` (Σ w0², over every rank) is recorded in each checkpoint and checked then.

λ that sets itself (`train.l2sp: auto`, `SelfSetLambda`): the run trains its first steps without the pull, then sets
λ so that the penalty at the end of a plain run would equal the loss that run gains (`self_set_lambda`). Two facts
make that computable from the first steps alone:
- The loss gained: the micro-batches of the window's first half are kept (at most PROBE = 8 micro-batches per rank),
  each with the loss it had when it was trained on; at the window's end they are run again, without a gradient. The
  difference is paired on the same samples, so the sample-to-sample spread of the training loss (a factor of two
  between steps of one sample each) cancels out of it. Their first losses are at weights close to w0: by the law
  below the first half of the window moves the weights a quarter of the window's distance or less.
- The drift at the end: under Adam each weight moves by about the learning rate each step, and a fine-tune keeps
  moving the same way, so ‖w − w0‖ grows as the sum of the learning rates and ‖w − w0‖² as its square. The plain
  fine-tune of the forgetting benchmark (128 steps) went from ‖w − w0‖² 1.26 after 8 steps to 266 at the end, the
  sum of its rates 15.6 times larger: 15.6^1.95. So D_T = D_W·(S_T/S_W)², S the rate summed over the steps.
The gain counted is the window's, which is less than the run's: λ errs low, the pull weaker than the plain run's
balance. The guard (train/guard.py) is what stops an export that forgets regardless.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def sq_sum(x: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """Σ x² in float64, a chunk at a time (a partition of a 1B-parameter drafter is never copied whole in float64)."""
    return sum((c.double().square().sum() for c in x.flatten().split(chunk)), torch.zeros((), dtype=torch.float64))


class L2SP:
    """The penalty on one rank's master partitions; `attach` hooks it to the optimizer that steps them."""

    def __init__(self, lam: float, partitions: list[torch.Tensor]) -> None:
        self.lam = lam
        self._params = [p for p in partitions if p.numel()]
        self.w0 = {id(p): p.detach().clone() for p in self._params}
        self.sq = torch.zeros((), dtype=torch.float64)  # Σ‖w − w0‖² of this rank's partitions at the last step
        self._step_sq: list[torch.Tensor] = []  # per partition stepped since the last end_step

    def local_w0_sq(self) -> torch.Tensor:
        """Σ w0² over this rank's partitions (float64); summed over the ranks it fingerprints w0."""
        return sum((sq_sum(w) for w in self.w0.values()), torch.zeros((), dtype=torch.float64))

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Every step of `optimizer` first adds 2λ(w − w0) to the gradient of each partition it steps."""
        optimizer.register_step_pre_hook(self._pre_step)

    def _pre_step(self, optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None or not p.numel():
                    continue
                w0 = self.w0.get(id(p))
                if w0 is None:
                    raise RuntimeError(
                        f"train.l2sp: the optimizer steps a tensor of {p.numel()} elements that is none of the "
                        "master partitions w0 was taken from"
                    )
                d = p.detach() - w0
                p.grad.add_(d, alpha=2 * self.lam)
                self._step_sq.append(sq_sum(d))

    def local_sq(self) -> torch.Tensor:
        """Σ‖w − w0‖² of this rank's partitions now (float64)."""
        return sum((sq_sum(p.detach() - self.w0[id(p)]) for p in self._params), torch.zeros((), dtype=torch.float64))

    def end_step(self) -> None:
        """After each optimizer step: `sq` becomes Σ‖w − w0‖² of this rank's partitions before that step's update."""
        if self._step_sq:
            self.sq = torch.stack(self._step_sq).sum()
            self._step_sq = []


MAX_LAMBDA = 1e4  # train.l2sp's own bound (eagle3ft/config_train.py)


def calibration_steps(total: int, warmup_steps: int) -> int:
    """The window trained without the pull: the warm-up or an eighth of the run, whichever is longer (at most all
    but the last step; 0: a one-step run has none). By the (Σ lr)² law its drift is a small part of the run's, and
    past the warm-up the rate, and so S_W, is not a sliver of its peak."""
    return min(max(warmup_steps, math.ceil(total / 8), 1), total - 1)


def self_set_lambda(gain: float, drift: float, lr_window: float, lr_total: float) -> tuple[float, str]:
    """(λ, why): the penalty at the end of a plain run, λ·D_T with D_T = drift·(lr_total / lr_window)², equals the loss
    gained. gain: the window's loss gain on its kept micro-batches; drift: ‖w − w0‖² at the window's end; lr_window,
    lr_total: the learning rate summed over the window's steps and over the run's."""
    if not gain > 0:
        return 0.0, f"the window gained no loss on its first micro-batches ({gain:+.4g}): no gain to balance, no pull"
    if not drift > 0 or not lr_window > 0:
        return 0.0, "the weights did not move in the window: no drift to extrapolate, no pull"
    end_drift = drift * (lr_total / lr_window) ** 2
    lam = min(gain / end_drift, MAX_LAMBDA)
    return lam, (
        f"λ·‖w − w0‖² at a plain run's end = the loss it gains: gain {gain:.4g} over the window, ‖w − w0‖² "
        f"{drift:.4g} there, x (Σlr run / Σlr window = {lr_total / lr_window:.3g})² = {end_drift:.4g} at the end"
    )


PROBE = 8  # micro-batches kept per rank, on the host


class SelfSetLambda:
    """train.l2sp auto: the calibration window of a warm start (the pull off), then λ set once, on every rank.

    `take(step, batch, loss)` keeps the micro-batches of the window's first half and their losses; `settle` runs them
    again at the window's end and sets `l2sp.lam`. The record (`record`) goes to RUN/train/l2sp.json, the metrics
    record of that step and each checkpoint (a resume past the window restores it)."""

    def __init__(self, total: int, warmup_steps: int, lr_at) -> None:
        self.window = calibration_steps(total, warmup_steps)
        self.lr_window = sum(lr_at(s) for s in range(self.window))
        self.lr_total = sum(lr_at(s) for s in range(total))
        self.probe: list[tuple[dict, float]] = []
        self.first_step: int | None = None  # the first step this process runs: the probe's steps start there
        self.record: dict | None = None

    @property
    def pending(self) -> bool:
        return self.record is None and self.window > 0

    def take(self, step: int, batch: dict, loss: torch.Tensor) -> None:
        """Before the update of step `step` (0-based): keep its micro-batch and loss when the step is in the first
        half of what is left of the window."""
        if not self.pending:
            return
        if self.first_step is None:
            self.first_step = step
        if step < self.first_step + max(1, math.ceil((self.window - self.first_step) / 2)) and len(self.probe) < PROBE:
            self.probe.append(({k: v.detach().cpu() for k, v in batch.items()}, float(loss.detach())))

    def due(self, step: int) -> bool:
        return self.pending and step >= self.window and self.first_step is not None

    @torch.no_grad()
    def settle(self, engine, l2sp: L2SP, reduce_sum, device, step: int) -> dict:
        """At the window's end (every rank): the kept micro-batches' loss gain and ‖w − w0‖², then λ."""
        diff = sum(loss - float(engine({k: v.to(device) for k, v in batch.items()}).loss) for batch, loss in self.probe)
        sums = reduce_sum(torch.tensor([diff, len(self.probe)], dtype=torch.float64, device=device))
        gain = float(sums[0] / sums[1]) if sums[1] > 0 else 0.0
        drift = float(reduce_sum(l2sp.local_sq().to(device)))
        lam, why = self_set_lambda(gain, drift, self.lr_window, self.lr_total)
        l2sp.lam = lam
        self.probe = []
        self.record = {
            "lambda": lam,
            "why": why,
            "step": step,
            "window": self.window,
            "probe_from_step": self.first_step + 1,
            "probe_micro_batches": int(sums[1]),
            "loss_gain": gain,
            "drift": drift,
            "lr_sum_window": self.lr_window,
            "lr_sum_run": self.lr_total,
        }
        return self.record

    def restore(self, saved: dict | None, l2sp: L2SP, step: int) -> str | None:
        """On a resume at `step`: the checkpoint's self-set λ, or a note when it has none past the window."""
        if saved is not None:
            self.record = saved
            l2sp.lam = saved["lambda"]
            return None
        if step >= self.window > 0:
            self.window = 0  # nothing to calibrate on any more
            return (
                f"train.l2sp auto: resumed at step {step}, past the calibration window, from a checkpoint that holds "
                "no self-set λ: the pull stays off"
            )
        return None


def write_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
