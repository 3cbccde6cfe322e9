"""The drafter's per-position losses, fused with its lm_head: x (N, H) through W (Vd, H) against the target's
distribution p over the draft vocabulary, in row chunks, so no (N, Vd) logits live in autograd.

`ce` (EAGLE-3's cross-entropy) and the acceptance-targeted losses of the overlap Σ min(p, q): tv, lk, lk_hybrid.
train/ttt.py calls `head_loss` from inside the lm_head module (LMHead), once per TTT step.
"""

from __future__ import annotations

import torch

from eagle3ft.drafter import wgrad

HEAD_CHUNK = None  # rows per chunk in the fused lm_head + cross-entropy; None: HEAD_CHUNK_BYTES of fp32 logits
HEAD_CHUNK_BYTES = 1 << 30


# --------------------------------------------------------------------------- fused head + CE


class _HeadCrossEntropy(torch.autograd.Function):
    """Per-row CE(p, softmax(x Wᵀ)) and argmax over row chunks; forward keeps softmax - p for backward.

    x (N, H); weight (Vd, H); ids (N, K) with p (N, K) (sparse target), or ids None with p (N, Vd).
    Holds at most `chunk` × Vd float32 logits at a time and saves d = softmax - p (N, Vd) in x's dtype,
    so backward is two GEMMs, gx = g · (d W) and gw = dᵀ (g · x), and recomputes no logits. With a weight-gradient
    stash (eagle3ft/drafter/wgrad.py, the TTT unroll) gw is the stash's: one GEMM over every step's rows at the weight's
    last use.
    """

    @staticmethod
    def forward(ctx, x, weight, ids, p, chunk, stash):
        def ce(a: int, b: int, logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            loss = -(p[a:b] * (logq.gather(1, ids[a:b]) if ids is not None else logq)).sum(-1)
            g = logq.exp_()  # softmax (c, Vd)
            if ids is not None:
                g.scatter_add_(1, ids[a:b], -p[a:b])
            else:
                g -= p[a:b]
            return loss, g

        return _over_row_chunks(ctx, x, weight, chunk, ce, stash)

    @staticmethod
    def backward(ctx, g_loss, _g_pred):
        return _head_backward(ctx, g_loss) + (None, None, None, None)


def _head_backward(ctx, g_loss) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(gx (N, H), gw (Vd, H) or None while a stash defers it) of both head losses, from the saved d."""
    x, weight, d = ctx.saved_tensors
    g = g_loss[:, None]  # (N, 1) float32
    gx = torch.mul(d @ weight, g, out=torch.empty_like(x))  # (N, H)
    xg = torch.mul(x, g, out=torch.empty_like(x)) if ctx.needs_input_grad[1] else None
    if ctx.stash is not None:
        return gx, ctx.stash.grad(weight, d if xg is not None else None, xg)
    return gx, None if xg is None else d.t() @ xg  # (Vd, H): one GEMM, fp32 accumulation inside


def _over_row_chunks(ctx, x, weight, chunk: int, per_chunk, stash):
    """The forward both head losses share: `chunk` rows of logits at a time, per_chunk(a, b, logq) -> (loss rows,
    dloss/dlogits rows); keeps d = dloss/dlogits (N, Vd) in x's dtype for the two-GEMM backward."""
    if stash is not None:
        stash.use(weight)
    ctx.stash = stash
    n = x.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=x.device)
    pred = torch.empty(n, dtype=torch.long, device=x.device)
    d = torch.empty(n, weight.shape[0], dtype=x.dtype, device=x.device)  # (N, Vd)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        logits = x[a:b] @ weight.t()  # (c, Vd)
        pred[a:b] = logits.argmax(-1)
        loss[a:b], d[a:b] = per_chunk(a, b, torch.log_softmax(logits, -1, dtype=torch.float32))
    ctx.save_for_backward(x, weight, d)
    ctx.mark_non_differentiable(pred)
    return loss, pred


def head_cross_entropy(x, weight, ids, p, chunk: int | None = None):
    """(per-row CE (N,) float32, argmax draft id (N,)); see _HeadCrossEntropy."""
    chunk = chunk or HEAD_CHUNK or max(1, HEAD_CHUNK_BYTES // (4 * weight.shape[0]))
    return _HeadCrossEntropy.apply(x, weight, ids, p, chunk, wgrad.active(weight))


# --------------------------------------------------------------------------- acceptance-targeted losses

LOSSES = ("ce", "tv", "lk", "lk_hybrid")
LK_EPS = 1e-5  # alpha is clamped here in -log(alpha), as speculators does (no gradient below it)


class _HeadOverlapLoss(torch.autograd.Function):
    """Per-row losses of the overlap alpha = Σ_v min(p_v, q_v) = 1 - TV(p, q), the greedy-free acceptance rate.

    q = softmax(x Wᵀ) over the draft vocab; p the target's distribution restricted to it, sparse ((N, K) ids and
    probabilities) or dense (ids None, (N, Vd)). kind:
      "tv":        1 - alpha
      "lk":        -log(max(alpha, LK_EPS))   (speculators' neg_log_acceptance; = CE when p is one-hot)
      "lk_hybrid": lam·KL(p‖q) + (1 - lam)·(1 - alpha), lam = exp(-eta·alpha) not differentiated
                   (Samarin et al., "LK Losses", arXiv 2602.23881; speculators' lk_hybrid)
    The gradient in the logits z: dalpha/dz_m = s_m - q_m·S with s_m = q_m·[q_m < p_m] (at the entries of p) and
    S = Σ_m s_m; dKL/dz = q - p. As _HeadCrossEntropy: `chunk` rows at a time, d = dloss/dz kept in x's dtype.
    """

    @staticmethod
    def forward(ctx, x, weight, ids, p, chunk, kind, eta, stash):
        def overlap(a: int, b: int, logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q = logq.exp()
            pc = p[a:b].float()  # (c, K) or (c, Vd)
            q_at = q.gather(1, ids[a:b]) if ids is not None else q  # q at p's entries
            s = q_at * (q_at < pc)  # where min(p, q) = q
            alpha = torch.minimum(pc, q_at).sum(-1)  # (c,)
            g_alpha = q * -s.sum(-1, keepdim=True)  # dalpha/dz (c, Vd)
            g_alpha = g_alpha.scatter_add_(1, ids[a:b], s) if ids is not None else g_alpha.add_(s)
            if kind == "tv":
                return 1 - alpha, g_alpha.neg_()
            if kind == "lk":
                scale = torch.where(alpha >= LK_EPS, -1 / alpha.clamp(min=LK_EPS), 0.0)[:, None]
                return -alpha.clamp(min=LK_EPS).log(), g_alpha.mul_(scale)
            logq_at = logq.gather(1, ids[a:b]) if ids is not None else logq  # lk_hybrid
            kl = (pc * (pc.clamp(min=1e-30).log() - logq_at)).sum(-1)  # Σ p log(p/q), 0·log 0 = 0
            lam = torch.exp(-eta * alpha)[:, None]  # (c, 1)
            g_kl = q.scatter_add(1, ids[a:b], -pc) if ids is not None else q - pc  # q - p
            return lam[:, 0] * kl + (1 - lam[:, 0]) * (1 - alpha), lam * g_kl - (1 - lam) * g_alpha

        return _over_row_chunks(ctx, x, weight, chunk, overlap, stash)

    @staticmethod
    def backward(ctx, g_loss, _g_pred):
        return _head_backward(ctx, g_loss) + (None,) * 6  # the same two GEMMs through d


def head_loss(x, weight, ids, p, loss: str = "ce", eta: float = 3.0, chunk: int | None = None):
    """(per-row loss (N,) float32, argmax draft id (N,)) for `loss` in LOSSES; ce is head_cross_entropy."""
    if loss == "ce":
        return head_cross_entropy(x, weight, ids, p, chunk)
    if loss not in LOSSES:
        raise ValueError(f"train.loss '{loss}' is not one of {', '.join(LOSSES)}")
    chunk = (
        chunk or HEAD_CHUNK or max(1, HEAD_CHUNK_BYTES // (12 * weight.shape[0]))
    )  # q, dalpha/dz, dKL/dz: 3 fp32 (c, Vd) at once
    return _HeadOverlapLoss.apply(x, weight, ids, p, chunk, loss, eta, wgrad.active(weight))
