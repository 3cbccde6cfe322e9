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
"""

from __future__ import annotations

import torch


def sq_sum(x: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """Σ x² in float64, a chunk at a time (a partition of a 1B-parameter drafter is never copied whole in float64)."""
    return sum((c.double().square().sum() for c in x.flatten().split(chunk)), torch.zeros((), dtype=torch.float64))


class L2SP:
    """The penalty on one rank's master partitions; `attach` hooks it to the optimizer that steps them."""

    def __init__(self, lam: float, partitions: list[torch.Tensor]) -> None:
        self.lam = lam
        self.w0 = {id(p): p.detach().clone() for p in partitions if p.numel()}
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

    def end_step(self) -> None:
        """After each optimizer step: `sq` becomes Σ‖w − w0‖² of this rank's partitions before that step's update."""
        if self._step_sq:
            self.sq = torch.stack(self._step_sq).sum()
            self._step_sq = []
