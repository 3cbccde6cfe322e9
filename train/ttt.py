"""Training-time test (TTT): unroll the drafter K steps over harvested features, as EAGLE-3 trains it.

Step 0, row t: fc(aux[t]) and emb(token t+1) at position t predict token t+2, whose target
distribution is the one stored at position t+1. Step k feeds back step k-1's pre-norm output at the
same row, with emb(token t+1+k) at position t+k, and predicts token t+2+k (stored at t+1+k).
Attention at step k sees the step-0 keys 0..t (causal) and the row's own key of steps 1..k, as
SGLang's draft decode does at inference. The causal part runs through one flash-attention call; the
diagonal keys are merged with it through the causal part's log-sum-exp, so nothing O(k·T²) is built,
and the backward hands the merged output and log-sum-exp back to the flash backward.

Loss = Σ_k decay^k · mean over valid positions of CE(p, q), where p is the target's distribution
restricted to the draft vocabulary and renormalised, and q the drafter's. A position is valid at
step k when the predicted token t+2+k has loss_mask 1 and p has mass in the draft vocabulary.
Instead of CE, `loss_kind` picks an acceptance-targeted loss of the overlap Σ min(p, q): tv, lk, lk_hybrid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from eagle3ft.train.model import Eagle3Drafter

# "flash": _FlashTTTAttention where the flash kernel runs; "lse": causal SDPA + causal_lse (the env var picks it per job)
ATTENTION = os.environ.get("EAGLE3FT_TTT_ATTENTION", "flash")
LSE_CHUNK = 256  # query rows per chunk when computing the causal log-sum-exp ("lse" path)
HEAD_CHUNK = None  # rows per chunk in the fused lm_head + cross-entropy; None: HEAD_CHUNK_BYTES of fp32 logits
HEAD_CHUNK_BYTES = 1 << 30


@dataclass
class TTTOutput:
    """Loss plus detached per-step counts (sum counts over batches and ranks before any ratio)."""

    loss: torch.Tensor  # scalar, differentiable
    step_loss: torch.Tensor  # (K,) mean CE per step
    correct: torch.Tensor  # (K,) positions where the draft argmax equals the target argmax
    valid: torch.Tensor  # (K,) valid positions
    chain_correct: torch.Tensor  # (K,) matches at step k among positions whose steps < k all matched
    chain_valid: torch.Tensor  # (K,) positions valid at k whose steps < k were all valid and matched

    @property
    def acc(self) -> torch.Tensor:
        return self.correct / self.valid.clamp(min=1)

    @property
    def cond_acc(self) -> torch.Tensor:
        return self.chain_correct / self.chain_valid.clamp(min=1)


# --------------------------------------------------------------------------- targets


def target_to_draft_map(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) long: the draft id of each target id, -1 outside the draft vocabulary."""
    draft_ids = torch.arange(d2t.shape[0], device=d2t.device)
    m = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    m[draft_ids + d2t] = draft_ids
    return m


def topk_to_draft(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, t2d_map: torch.Tensor):
    """Stored top-k (…, K) over target ids -> (draft ids (…, K), p (…, K) renormalised, has_mass (…)).

    Mass on tokens outside the draft vocabulary is dropped; entries outside get id 0 and p 0.
    """
    ids = t2d_map[topk_ids.long()]  # (…, K)
    inside = ids >= 0
    p = topk_logprobs.float().exp() * inside
    mass = p.sum(-1, keepdim=True)  # (…, 1)
    return ids.clamp(min=0), p / mass.clamp(min=1e-30), mass[..., 0] > 0


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t + n] at row t (zero past the end); x is (B, T, ...)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


class Documents:
    """Packed rows (train/data.py): each row holds whole documents back to back, positions restarting at 0.

    Attention stays inside a document (a block-diagonal causal mask, or varlen flash on CUDA), and a row
    trains only on targets of its own document.
    """

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions  # (B, T) long, 0 at each document's first token
        B, T = positions.shape
        starts = (positions.reshape(-1) == 0).nonzero()[:, 0]  # (D,) first rows of the documents in the flat (B*T) rows
        self.cu_seqlens = torch.cat([starts, starts.new_tensor([B * T])]).to(torch.int32)  # (D+1,)
        self.max_len = int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())
        self._mask = None

    def same(self, n: int) -> torch.Tensor:
        """(B, T) bool: row t + n lies in row t's document."""
        return shift(self.positions, n) == self.positions + n

    def mask(self) -> torch.Tensor:
        """(B, 1, T, T) bool: query t may attend key s (same document, s <= t); built once per batch."""
        if self._mask is None:
            doc = (self.positions == 0).cumsum(-1)  # (B, T) document number within the row
            T = doc.shape[1]
            causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
            self._mask = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]
        return self._mask


# --------------------------------------------------------------------------- fused head + CE


class _HeadCrossEntropy(torch.autograd.Function):
    """Per-row CE(p, softmax(x Wᵀ)) and argmax over row chunks; forward keeps softmax - p for backward.

    x (N, H); weight (Vd, H); ids (N, K) with p (N, K) (sparse target), or ids None with p (N, Vd).
    Holds at most `chunk` × Vd float32 logits at a time and saves d = softmax - p (N, Vd) in x's dtype,
    so backward is two GEMMs, gx = g · (d W) and gw = dᵀ (g · x), and recomputes no logits.
    """

    @staticmethod
    def forward(ctx, x, weight, ids, p, chunk):
        n = x.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=x.device)
        pred = torch.empty(n, dtype=torch.long, device=x.device)
        d = torch.empty(n, weight.shape[0], dtype=x.dtype, device=x.device)  # (N, Vd)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            logits = x[a:b] @ weight.t()  # (c, Vd)
            logq = torch.log_softmax(logits, -1, dtype=torch.float32)  # (c, Vd)
            loss[a:b] = -(p[a:b] * (logq.gather(1, ids[a:b]) if ids is not None else logq)).sum(-1)
            pred[a:b] = logits.argmax(-1)
            g = logq.exp_()  # softmax (c, Vd)
            if ids is not None:
                g.scatter_add_(1, ids[a:b], -p[a:b])
            else:
                g -= p[a:b]
            d[a:b] = g
        ctx.save_for_backward(x, weight, d)
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, g_loss, _g_pred):
        x, weight, d = ctx.saved_tensors
        g = g_loss[:, None]  # (N, 1) float32
        gx = torch.mul(d @ weight, g, out=torch.empty_like(x))  # (N, H)
        gw = d.t() @ torch.mul(x, g, out=torch.empty_like(x))  # (Vd, H): one GEMM, fp32 accumulation inside
        return gx, gw, None, None, None


def head_cross_entropy(x, weight, ids, p, chunk: int | None = None):
    """(per-row CE (N,) float32, argmax draft id (N,)); see _HeadCrossEntropy."""
    chunk = chunk or HEAD_CHUNK or max(1, HEAD_CHUNK_BYTES // (4 * weight.shape[0]))
    return _HeadCrossEntropy.apply(x, weight, ids, p, chunk)


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
    def forward(ctx, x, weight, ids, p, chunk, kind, eta):
        n = x.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=x.device)
        pred = torch.empty(n, dtype=torch.long, device=x.device)
        d = torch.empty(n, weight.shape[0], dtype=x.dtype, device=x.device)  # (N, Vd)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            logits = x[a:b] @ weight.t()  # (c, Vd)
            pred[a:b] = logits.argmax(-1)
            logq = torch.log_softmax(logits, -1, dtype=torch.float32)  # (c, Vd)
            q = logq.exp()
            pc = p[a:b].float()  # (c, K) or (c, Vd)
            q_at = q.gather(1, ids[a:b]) if ids is not None else q  # q at p's entries
            s = q_at * (q_at < pc)  # where min(p, q) = q
            alpha = torch.minimum(pc, q_at).sum(-1)  # (c,)
            g_alpha = q * -s.sum(-1, keepdim=True)  # dalpha/dz (c, Vd)
            g_alpha = g_alpha.scatter_add_(1, ids[a:b], s) if ids is not None else g_alpha.add_(s)
            if kind == "tv":
                loss[a:b] = 1 - alpha
                g = g_alpha.neg_()
            elif kind == "lk":
                loss[a:b] = -alpha.clamp(min=LK_EPS).log()
                g = g_alpha.mul_(torch.where(alpha >= LK_EPS, -1 / alpha.clamp(min=LK_EPS), 0.0)[:, None])
            else:  # lk_hybrid
                logq_at = logq.gather(1, ids[a:b]) if ids is not None else logq
                kl = (pc * (pc.clamp(min=1e-30).log() - logq_at)).sum(-1)  # Σ p log(p/q), 0·log 0 = 0
                lam = torch.exp(-eta * alpha)[:, None]  # (c, 1)
                loss[a:b] = lam[:, 0] * kl + (1 - lam[:, 0]) * (1 - alpha)
                g_kl = q.scatter_add(1, ids[a:b], -pc) if ids is not None else q - pc  # q - p
                g = lam * g_kl - (1 - lam) * g_alpha
            d[a:b] = g
        ctx.save_for_backward(x, weight, d)
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, g_loss, g_pred):
        return *_HeadCrossEntropy.backward(ctx, g_loss, g_pred), None, None  # the same two GEMMs through d


def head_loss(x, weight, ids, p, loss: str = "ce", eta: float = 3.0, chunk: int | None = None):
    """(per-row loss (N,) float32, argmax draft id (N,)) for `loss` in LOSSES; ce is head_cross_entropy."""
    if loss == "ce":
        return head_cross_entropy(x, weight, ids, p, chunk)
    if loss not in LOSSES:
        raise ValueError(f"train.loss '{loss}' is not one of {', '.join(LOSSES)}")
    chunk = (
        chunk or HEAD_CHUNK or max(1, HEAD_CHUNK_BYTES // (12 * weight.shape[0]))
    )  # q, dalpha/dz, dKL/dz: 3 fp32 (c, Vd) at once
    return _HeadOverlapLoss.apply(x, weight, ids, p, chunk, loss, eta)


# --------------------------------------------------------------------------- attention


def causal_lse(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """log Σ_{s≤t} exp(scale · q_t·k_s), (B, nh, T) float32, with the exact gradient.

    The value is computed without grad in row chunks; the gradient (scale·E_p[k] for q, scale·p·q
    for k) comes from one extra SDPA call with k as the values and detached scores. mask (B, 1, T, T)
    bool (Documents.mask) replaces the causal mask.
    """
    B, nh, T, hd = q.shape
    rep = nh // k.shape[1]
    with torch.no_grad():
        qg = q.view(B, k.shape[1], rep, T, hd).float()  # (B, nkv, rep, T, hd)
        kg = k[:, :, None].float()  # (B, nkv, 1, T, hd)
        lse = torch.empty(B, k.shape[1], rep, T, dtype=torch.float32, device=q.device)
        for a in range(0, T, LSE_CHUNK):
            b = min(a + LSE_CHUNK, T)
            s = (qg[..., a:b, :] @ kg[..., :b, :].transpose(-1, -2)) * scale  # (B, nkv, rep, c, b)
            rows = torch.arange(a, b, device=q.device)[:, None]
            if mask is None:
                s = s.masked_fill(torch.arange(b, device=q.device)[None, :] > rows, float("-inf"))
            else:
                s = s.masked_fill(~mask[:, :, None, a:b, :b], float("-inf"))
            lse[..., a:b] = torch.logsumexp(s, dim=-1)
        lse = lse.view(B, nh, T)
    u = F.scaled_dot_product_attention(
        q.detach(), k.detach(), k, attn_mask=mask, is_causal=mask is None, enable_gqa=rep > 1
    )  # (B, nh, T, hd)
    surrogate = scale * (q * u).float().sum(-1)  # (B, nh, T)
    return lse + surrogate - surrogate.detach()


def _varlen(x: torch.Tensor) -> torch.Tensor:
    """(B, nh, T, hd) -> (B*T, nh, hd), the layout of varlen flash."""
    B, nh, T, hd = x.shape
    return x.transpose(1, 2).reshape(B * T, nh, hd)


def _unvarlen(x: torch.Tensor, B: int) -> torch.Tensor:
    """(B*T, nh, hd) -> (B, nh, T, hd), a view."""
    return x.view(B, -1, *x.shape[1:]).transpose(1, 2)


def _flash_forward(q, k, v, scale, docs: Documents | None = None):
    """Causal flash attention: (out (B, nh, T, hd), lse (B, nh, T) float32, what the backward op needs).

    With docs, causal within each document: varlen flash on CUDA, the document mask on the CPU."""
    if docs is not None:
        if q.is_cuda:
            B, nh, T, _ = q.shape
            cu, n = docs.cu_seqlens, docs.max_len
            out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
                _varlen(q), _varlen(k), _varlen(v), cu, cu, n, n, 0.0, True, False, scale=scale
            )
            if lse.shape != (nh, B * T):
                raise RuntimeError(
                    f"varlen flash returned a log-sum-exp of shape {tuple(lse.shape)}, not (heads, tokens) = {(nh, B * T)}; set eagle3ft.train.ttt.ATTENTION = 'lse'"
                )
            return _unvarlen(out, B), lse.view(nh, B, T).transpose(0, 1), (rng, unused)
        bias = torch.zeros(docs.mask().shape, dtype=q.dtype, device=q.device).masked_fill_(~docs.mask(), float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )
        return out, lse, (bias,)
    if q.is_cuda:
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return r[0], r[1], r[2:8]  # cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _flash_backward(g, q, k, v, out, lse, extra, scale, docs: Documents | None = None):
    """(dq, dk, dv) of causal attention given its output and log-sum-exp (which may include keys beyond k)."""
    if docs is not None:
        if q.is_cuda:
            B, nh, T, _ = q.shape
            cu, n = docs.cu_seqlens, docs.max_len
            lse = lse.transpose(0, 1).reshape(nh, B * T).contiguous()
            grads = torch.ops.aten._flash_attention_backward(
                _varlen(g),
                _varlen(q),
                _varlen(k),
                _varlen(v),
                _varlen(out),
                lse,
                cu,
                cu,
                n,
                n,
                0.0,
                True,
                *extra,
                scale=scale,
            )
            return tuple(_unvarlen(x, B) for x in grads)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, out, lse, 0.0, False, attn_mask=extra[0], scale=scale
        )
    if q.is_cuda:
        cq, ck, mq, mk, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out, lse, 0.0, True, scale=scale
    )


def _weighted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (…, hd) times float32 weights w (…) per row, computed in float32, stored in x's dtype."""
    return torch.mul(x, w[..., None], out=torch.empty_like(x))


class _FlashTTTAttention(torch.autograd.Function):
    """ttt_attention for nh == nkv in one flash call plus O(k·T·hd) elementwise work.

    Forward: flash gives the causal output o_c and lse_c; the diagonal scores s_j = scale q·k_j are merged,
    lse = logaddexp(lse_c, logsumexp_j s_j), out = exp(lse_c - lse) o_c + Σ_j exp(s_j - lse) v_j.
    Backward: the flash backward given (out, lse) of the whole key set yields the exact causal-key gradients
    (its probabilities exp(s - lse) and D = rowsum(dout · out) are those of the merged softmax); the diagonal
    keys add p_j = exp(s_j - lse): dv_j = p_j dout, ds_j = p_j (dout·v_j - D), dq += scale ds_j k_j,
    dk_j = scale ds_j q.
    """

    @staticmethod
    def forward(ctx, docs, q, k0, v0, *diag):
        n = len(diag) // 2
        diag_k, diag_v = diag[:n], diag[n:]
        scale = q.shape[-1] ** -0.5
        out, lse_c, extra = _flash_forward(q, k0, v0, scale, docs)  # (B, nh, T, hd), (B, nh, T)
        lse_c = lse_c[..., : q.shape[2]]
        if n:
            s = torch.stack([(q * kj).sum(-1, dtype=torch.float32) * scale for kj in diag_k])  # (n, B, nh, T)
            lse = torch.logaddexp(lse_c, torch.logsumexp(s, 0)).contiguous()  # (B, nh, T)
            out.mul_((lse_c - lse).exp()[..., None])
        else:  # step 0 of a packed batch: the document-causal part alone
            s, lse = lse_c.new_empty(0), lse_c.contiguous()
        for sj, vj in zip(s, diag_v):
            out.addcmul_(vj, (sj - lse).exp()[..., None])
        ctx.save_for_backward(q, k0, v0, out, lse, s, *diag)
        ctx.extra, ctx.scale, ctx.n, ctx.docs = extra, scale, n, docs
        return out

    @staticmethod
    def backward(ctx, g):
        q, k0, v0, out, lse, s, *diag = ctx.saved_tensors
        diag_k, diag_v = diag[: ctx.n], diag[ctx.n :]
        if g.stride(-1) != 1:
            g = g.contiguous()
        dq, dk0, dv0 = _flash_backward(g, q, k0, v0, out, lse, ctx.extra, ctx.scale, ctx.docs)
        D = (g * out).sum(-1, dtype=torch.float32)  # (B, nh, T)
        dks, dvs = [], []
        for sj, kj, vj in zip(s, diag_k, diag_v):
            pj = (sj - lse).exp()  # (B, nh, T)
            ds = pj * ((g * vj).sum(-1, dtype=torch.float32) - D) * ctx.scale  # (B, nh, T)
            dq.addcmul_(kj, ds[..., None])
            dks.append(_weighted(q, ds))
            dvs.append(_weighted(g, pj))
        return None, dq, dk0, dv0, *dks, *dvs


def _flash_ok(q: torch.Tensor) -> bool:
    if ATTENTION != "flash" or q.shape[-1] % 8 or q.shape[-1] > 256:
        return False
    return q.device.type == "cpu" or (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16))


def _heads(x: torch.Tensor, nh: int) -> torch.Tensor:
    return x.repeat_interleave(nh // x.shape[1], dim=1) if x.shape[1] != nh else x  # (B, nkv, T, hd) -> (B, nh, T, hd)


def ttt_attention(
    q, k0, v0, diag_k: list[torch.Tensor], diag_v: list[torch.Tensor], docs: Documents | None = None
) -> torch.Tensor:
    """Attention of q (B, nh, T, hd) over causal step-0 keys k0/v0 (B, nkv, T, hd) plus, for row t,
    the diagonal keys diag_k[j][:, :, t] (one per step 1..k). Returns (B, nh, T, hd).
    With docs (packed rows) the step-0 keys are those of row t's own document only."""
    if (diag_k or docs is not None) and _flash_ok(q):
        nh = q.shape[1]
        return _FlashTTTAttention.apply(docs, q, *(_heads(x, nh) for x in (k0, v0, *diag_k, *diag_v)))
    return lse_attention(q, k0, v0, diag_k, diag_v, docs)


def lse_attention(
    q, k0, v0, diag_k: list[torch.Tensor], diag_v: list[torch.Tensor], docs: Documents | None = None
) -> torch.Tensor:
    """ttt_attention through causal SDPA, merged with the diagonal keys by causal_lse (the "lse" path)."""
    nh = q.shape[1]
    mask = docs.mask() if docs is not None else None  # (B, 1, T, T) or None: plain causal
    causal = F.scaled_dot_product_attention(
        q, k0, v0, attn_mask=mask, is_causal=mask is None, enable_gqa=nh != k0.shape[1]
    )  # (B, nh, T, hd)
    if not diag_k:
        return causal
    scale = q.shape[-1] ** -0.5
    lse = causal_lse(q, k0, scale, mask)  # (B, nh, T)
    d = torch.stack([scale * (q * _heads(kj, nh)).float().sum(-1) for kj in diag_k])  # (k, B, nh, T)
    m = torch.maximum(lse, d.max(0).values).detach()  # (B, nh, T)
    w_c, w_d = (lse - m).exp(), (d - m).exp()  # (B, nh, T), (k, B, nh, T)
    z = w_c + w_d.sum(0)
    # mix in the activation dtype (weights from fp32), so autograd keeps no fp32 copy of any value tensor
    out = (w_c / z).to(q.dtype)[..., None] * causal
    for wj, vj in zip(w_d, diag_v):
        out = out + (wj / z).to(q.dtype)[..., None] * _heads(vj, nh)
    return out


# --------------------------------------------------------------------------- the unroll


def ttt_targets(model: Eagle3Drafter, batch: dict[str, torch.Tensor], target_head: torch.Tensor | None = None):
    """(target argmax (B, T), draft ids (B, T, K) or None, p (B, T, K) or (B, T, Vd), has_mass (B, T)).

    Row t holds the target's next-token distribution over token t+1: from the stored top-k, or with
    target_head (the target's lm_head rows of the draft vocabulary, (Vd, Ht)) the exact draft-vocab
    softmax of `last_hidden`.
    """
    target_argmax = batch["topk_ids"][..., 0].long()  # (B, T) the target's greedy next token, over token t+1
    if target_head is not None:
        with torch.no_grad():
            p_all = torch.softmax(
                (batch["last_hidden"].to(target_head.dtype) @ target_head.t()).float(), -1
            )  # (B, T, Vd)
        return target_argmax, None, p_all, torch.ones_like(batch["loss_mask"].bool())
    ids_all, p_all, has_mass = topk_to_draft(
        batch["topk_ids"], batch["topk_logprobs"], target_to_draft_map(model.d2t, model.config.vocab_size)
    )
    return target_argmax, ids_all, p_all, has_mass


def ttt_forward(
    model: Eagle3Drafter,
    batch: dict[str, torch.Tensor],
    steps: int = 7,
    decay: float = 0.8,
    target_head: torch.Tensor | None = None,
    loss_kind: str = "ce",
    lk_eta: float = 3.0,
) -> TTTOutput:
    """Unroll `steps` TTT steps over a collated batch (data/store.py's `collate`).

    target_head: the target's lm_head rows of the draft vocabulary (Vd, Ht), to take p from
    `last_hidden` (exact draft-vocab softmax) instead of the stored top-k.
    loss_kind: the per-position loss, one of LOSSES (see head_loss); lk_eta is lk_hybrid's eta.
    """
    ids = batch["input_ids"].long()  # (B, T)
    B, T = ids.shape
    dtype = model.fc.weight.dtype
    dev = ids.device
    hidden = model.fuse(batch["aux_hidden"].to(dtype))  # (B, T, H); fc once
    docs = Documents(batch["position_ids"]) if "position_ids" in batch else None  # packed rows (train/data.py)
    positions = docs.positions if docs is not None else torch.arange(T, device=dev).expand(B, T)
    loss_mask = batch["loss_mask"].bool()  # (B, T)
    target_argmax, ids_all, p_all, has_mass = ttt_targets(model, batch, target_head)

    # the valid rows of every step at once: one host sync per batch instead of several per step
    valid = torch.stack(
        [shift(loss_mask, 2 + k) & shift(has_mass, 1 + k) for k in range(steps)]
    )  # (K, B, T) token t+2+k is trained on
    if docs is not None:  # ... and lies in row t's document
        valid &= torch.stack([docs.same(2 + k) for k in range(steps)])
    valid = valid.view(steps, B * T)
    counts = valid.sum(1)  # (K,)
    rows = valid.nonzero()[:, 1].split(counts.tolist())  # K × (N_k,) flat row indices b*T + t, ascending

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(B * T, *x.shape[2:])  # (B, T, …) -> (B*T, …)

    p_flat, ids_flat, argmax_flat = flat(p_all), flat(ids_all) if ids_all is not None else None, flat(target_argmax)

    loss = hidden.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(5, steps, device=dev)  # step_loss, correct, valid, chain_correct, chain_valid
    chain_ok = torch.ones(B * T, dtype=torch.bool, device=dev)
    k0 = v0 = None
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    for k in range(steps):
        tokens = shift(ids, 1 + k)  # (B, T) token t+1+k
        q, kk, vv = model.qkv(tokens, hidden, positions + k)  # q (B, nh, T, hd); kk, vv (B, nkv, T, hd)
        if k == 0:
            k0, v0 = kk, vv
        else:
            diag_k.append(kk)
            diag_v.append(vv)
        out = model.midlayer.finish(ttt_attention(q, k0, v0, diag_k, diag_v, docs), hidden)  # (B, T, H) pre-norm

        r, ahead = rows[k], rows[k] + 1 + k  # (N,) valid rows; the rows holding their targets (t+1+k)
        xn = model.norm(flat(out).index_select(0, r))  # (N, H)
        p = p_flat.index_select(0, ahead)  # (N, K) or (N, Vd): the target distribution stored at t+1+k
        tid = ids_flat.index_select(0, ahead) if ids_flat is not None else None
        per_row, pred = model.lm_head(xn, partial(head_loss, ids=tid, p=p, loss=loss_kind, eta=lk_eta))  # (N,), (N,)
        n = counts[k]
        step_loss = per_row.sum() / n.clamp(min=1)
        loss = loss + decay**k * step_loss

        with torch.no_grad():
            hit = model.draft_to_target(pred) == argmax_flat.index_select(0, ahead)  # (N,)
            match = torch.zeros_like(chain_ok).scatter_(0, r, hit)  # (B*T,)
            chain_valid = chain_ok & valid[k]
            stats[:, k] = torch.stack(
                [step_loss.detach(), match.sum(), n, (chain_valid & match).sum(), chain_valid.sum()]
            ).float()
            chain_ok = chain_valid & match
        hidden = model.feedback(out)  # pre-norm out, or norm(out) with norm_output (EAGLE-3.1)
    return TTTOutput(loss, *stats)


class TTTObjective(torch.nn.Module):
    """The drafter plus its TTT loss as one module, so that a distributed engine runs `forward(batch)`."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        steps: int,
        decay: float,
        target_head: torch.Tensor | None = None,
        loss: str = "ce",
        lk_eta: float = 3.0,
    ) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"train.loss '{loss}' is not one of {', '.join(LOSSES)}")
        self.drafter, self.steps, self.decay, self.loss, self.lk_eta = drafter, steps, decay, loss, lk_eta
        self.register_buffer("target_head", target_head, persistent=False)  # (Vd, Ht) or None

    def forward(self, batch: dict[str, torch.Tensor], steps: int | None = None) -> TTTOutput:
        """The TTT unroll; `steps` overrides the training depth (held-out τ at the eval depth)."""
        return ttt_forward(
            self.drafter, batch, steps or self.steps, self.decay, self.target_head, self.loss, self.lk_eta
        )
