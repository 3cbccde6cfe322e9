"""train/ttt.py as of commit 8e045a1, before the train-step speed work: the `baseline` variant of train_speed.py.

What the speed work changed is kept here as it was (the fused head loss with recompute, the per-step
unroll); what it left alone is imported: the targets, shift, TTTOutput, and the SDPA + causal_lse attention
(train/attention.py's "lse" path, the same code).
"""

from __future__ import annotations

from functools import partial

import torch

from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.train.attention import lse_attention as ttt_attention
from eagle3ft.train.attention import shift
from eagle3ft.train.ttt import TTTOutput, ttt_targets

HEAD_CHUNK = 1024  # rows per chunk in the fused lm_head + cross-entropy


def rows_ahead(x: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """x[b, t + n] for every (b, t) where rows (B, T) is True, without copying x; rows must be False for t >= T - n."""
    return x[:, n:][rows[:, : x.shape[1] - n]]


# --------------------------------------------------------------------------- fused head + CE


class _HeadCrossEntropy(torch.autograd.Function):
    """Per-row CE(p, softmax(x Wᵀ)) and argmax, over row chunks, recomputing logits in backward.

    x (N, H); weight (Vd, H); ids (N, K) with p (N, K) (sparse target), or ids None with p (N, Vd).
    Never holds more than HEAD_CHUNK × Vd logits.
    """

    @staticmethod
    def forward(ctx, x, weight, ids, p, chunk):
        n = x.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=x.device)
        pred = torch.empty(n, dtype=torch.long, device=x.device)
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        for a in range(0, n, chunk):
            logits = (x[a : a + chunk] @ weight.t()).float()  # (c, Vd)
            lse[a : a + chunk] = torch.logsumexp(logits, dim=-1)
            pl = logits.gather(1, ids[a : a + chunk]) if ids is not None else logits
            loss[a : a + chunk] = lse[a : a + chunk] - (p[a : a + chunk] * pl).sum(-1)
            pred[a : a + chunk] = logits.argmax(-1)
        ctx.save_for_backward(x, weight, ids if ids is not None else torch.empty(0), p, lse)
        ctx.sparse, ctx.chunk = ids is not None, chunk
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, g_loss, _g_pred):
        x, weight, ids, p, lse = ctx.saved_tensors
        gx = torch.empty_like(x)
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for a in range(0, x.shape[0], ctx.chunk):
            xc = x[a : a + ctx.chunk]
            logits = (xc @ weight.t()).float()
            g = (logits - lse[a : a + ctx.chunk, None]).exp()  # softmax (c, Vd)
            if ctx.sparse:
                g.scatter_add_(1, ids[a : a + ctx.chunk], -p[a : a + ctx.chunk])
            else:
                g -= p[a : a + ctx.chunk]
            g = (g * g_loss[a : a + ctx.chunk, None]).to(x.dtype)
            gx[a : a + ctx.chunk] = g @ weight
            gw += (g.t() @ xc).float()
        return gx, gw.to(weight.dtype), None, None, None


def head_cross_entropy(x, weight, ids, p, chunk: int | None = None):
    """(per-row CE (N,) float32, argmax draft id (N,)); see _HeadCrossEntropy."""
    return _HeadCrossEntropy.apply(x, weight, ids, p, chunk or HEAD_CHUNK)


# --------------------------------------------------------------------------- attention


# --------------------------------------------------------------------------- the unroll


def ttt_forward(
    model: Eagle3Drafter,
    batch: dict[str, torch.Tensor],
    steps: int = 7,
    decay: float = 0.8,
    target_head: torch.Tensor | None = None,
) -> TTTOutput:
    """Unroll `steps` TTT steps over a collated batch (data/store.py's `collate`).

    target_head: the target's lm_head rows of the draft vocabulary (Vd, Ht), to take p from
    `last_hidden` (exact draft-vocab softmax) instead of the stored top-k.
    """
    ids = batch["input_ids"].long()  # (B, T)
    B, T = ids.shape
    dtype = model.fc.weight.dtype
    dev = ids.device
    hidden = model.fuse(batch["aux_hidden"].to(dtype))  # (B, T, H); fc once
    positions = torch.arange(T, device=dev).expand(B, T)
    loss_mask = batch["loss_mask"].bool()  # (B, T)
    target_argmax, ids_all, p_all, has_mass = ttt_targets(model, batch, target_head)

    loss = hidden.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(5, steps, device=dev)  # step_loss, correct, valid, chain_correct, chain_valid
    chain_ok = torch.ones(B, T, dtype=torch.bool, device=dev)
    k0 = v0 = None
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    for k in range(steps):
        tokens = shift(ids, 1 + k)  # (B, T) token t+1+k
        valid = shift(loss_mask, 2 + k) & shift(has_mass, 1 + k)  # (B, T) token t+2+k is trained on
        q, kk, vv = model.qkv(tokens, hidden, positions + k)  # q (B, nh, T, hd); kk, vv (B, nkv, T, hd)
        if k == 0:
            k0, v0 = kk, vv
        else:
            diag_k.append(kk)
            diag_v.append(vv)
        out = model.midlayer.finish(ttt_attention(q, k0, v0, diag_k, diag_v), hidden)  # (B, T, H) pre-norm

        xn = model.norm(out[valid])  # (N, H)
        p = rows_ahead(p_all, valid, 1 + k)  # (N, K) or (N, Vd): the target distribution stored at t+1+k
        tid = rows_ahead(ids_all, valid, 1 + k) if ids_all is not None else None
        ce, pred = model.lm_head(xn, partial(head_cross_entropy, ids=tid, p=p))  # (N,), (N,)
        n = valid.sum()
        step_loss = ce.sum() / n.clamp(min=1)
        loss = loss + decay**k * step_loss

        with torch.no_grad():
            match = torch.zeros_like(valid)
            match[valid] = model.draft_to_target(pred) == rows_ahead(target_argmax, valid, 1 + k)
            chain_valid = chain_ok & valid
            stats[:, k] = torch.stack(
                [step_loss.detach(), match.sum(), n, (chain_valid & match).sum(), chain_valid.sum()]
            ).float()
            chain_ok = chain_valid & match
        hidden = out
    return TTTOutput(loss, *stats)


class TTTObjective(torch.nn.Module):
    """The drafter plus its TTT loss as one module, so that a distributed engine runs `forward(batch)`."""

    def __init__(
        self, drafter: Eagle3Drafter, steps: int, decay: float, target_head: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.drafter, self.steps, self.decay = drafter, steps, decay
        self.register_buffer("target_head", target_head, persistent=False)  # (Vd, Ht) or None

    def forward(self, batch: dict[str, torch.Tensor]) -> TTTOutput:
        return ttt_forward(self.drafter, batch, self.steps, self.decay, self.target_head)
