"""Deferred weight gradients: one GEMM per weight over all the TTT steps that used it.

The drafter's midlayer and lm_head run once per TTT step, so autograd computes each of their weight gradients K
times (one GEMM per step) and adds them up: K - 1 weight-sized additions. At Kimi-K2 dimensions, deferring them
took 7.5 ms off the step for 3.9 GiB more memory on one GPU.

Inside `deferred()` (train/ttt.py's unroll) each use is counted in the forward. In the backward every use but the
weight's last hands its (grad_output, input) rows to the stash and returns no weight gradient; the last use returns
cat(g)ᵀ · cat(x), the sum, accumulated in float32 inside one GEMM. Only the weight's own gradient changes place, so
an engine's hooks (DeepSpeed ZeRO) still fire once per weight, with the full sum. A use whose backward never ran
would lose its share silently; the check at the end of the backward pass raises instead.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

DEFER = True  # False: autograd's per-step weight gradients (a benchmark knob)
_ACTIVE: contextvars.ContextVar[WeightGradStash | None] = contextvars.ContextVar("eagle3ft_wgrad", default=None)


@dataclass
class _Uses:
    weight: torch.Tensor
    left: int = 0  # uses whose backward has not run yet
    g: list[torch.Tensor] = field(default_factory=list)  # (N_i, out) gradients of the outputs
    x: list[torch.Tensor] = field(default_factory=list)  # (N_i, in) inputs


class WeightGradStash:
    """The uses of each weight in one forward pass, and their (grad_output, input) rows until the last backward."""

    def __init__(self) -> None:
        self.uses: dict[int, _Uses] = {}
        self.cats: dict[tuple, tuple] = {}  # row list -> (rows, their concatenation), shared by q/k/v and gate/up
        self.check_queued = False

    def use(self, weight: torch.Tensor) -> None:
        self.uses.setdefault(id(weight), _Uses(weight)).left += 1

    def grad(self, weight: torch.Tensor, g: torch.Tensor | None, x: torch.Tensor | None) -> torch.Tensor | None:
        """One use's backward: gᵀx joins the weight's sum; returns the sum at its last use, else None.
        g (N, out) and x (N, in); None for both when autograd needs no gradient of this weight."""
        if not self.check_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._check)
            self.check_queued = True
        u = self.uses[id(weight)]
        u.left -= 1
        if g is not None:
            u.g.append(g)
            u.x.append(x)
        if u.left:
            return None
        del self.uses[id(weight)]
        if not u.g:
            return None
        if len(u.g) == 1:
            return u.g[0].t() @ u.x[0]
        return self._cat(u.g).t() @ self._cat(u.x)  # (out, in)

    def _cat(self, rows: list[torch.Tensor]) -> torch.Tensor:
        key = tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride())) for t in rows)
        if key not in self.cats:  # the entry keeps `rows` alive, so no other tensor can reuse their addresses
            self.cats[key] = (rows, torch.cat(rows))
        return self.cats[key][1]

    def _check(self) -> None:
        left = [tuple(u.weight.shape) for u in self.uses.values() if u.left]
        self.uses.clear()
        self.cats.clear()
        self.check_queued = False
        if left:
            raise RuntimeError(
                f"deferred weight gradients: {len(left)} weight(s) of shapes {left} had uses whose backward never "
                "ran, so their gradients would be incomplete; every use inside drafter.wgrad.deferred() must reach "
                "the loss"
            )


@contextlib.contextmanager
def deferred():
    """Weight gradients of `linear` and the fused head losses are deferred for the uses made inside."""
    token = _ACTIVE.set(WeightGradStash() if DEFER else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active(weight: torch.Tensor) -> WeightGradStash | None:
    """The stash that `weight`'s use made now should report to, or None (no deferral, no grad, a frozen weight)."""
    stash = _ACTIVE.get()
    return stash if stash is not None and torch.is_grad_enabled() and weight.requires_grad else None


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, stash):
        stash.use(weight)
        ctx.save_for_backward(x, weight)
        ctx.stash = stash
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = g @ weight if ctx.needs_input_grad[0] else None  # (…, in)
        rows = (g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else (None, None)
        return gx, ctx.stash.grad(weight, *rows), None


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear without bias, its weight gradient deferred inside `deferred()`."""
    stash = active(weight)
    return F.linear(x, weight) if stash is None else _DeferredLinear.apply(x, weight, stash)
