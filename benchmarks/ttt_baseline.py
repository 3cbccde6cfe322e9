"""train/ttt.py as of commit 8e045a1, before the train-step speed work: the `baseline` variant of train_speed.py."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from eagle3ft.train.model import Eagle3Drafter

LSE_CHUNK = 256  # query rows per chunk when computing the causal log-sum-exp
HEAD_CHUNK = 1024  # rows per chunk in the fused lm_head + cross-entropy


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


def rows_ahead(x: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """x[b, t + n] for every (b, t) where rows (B, T) is True, without copying x; rows must be False for t >= T - n."""
    return x[:, n:][rows[:, : x.shape[1] - n]]


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t + n] at row t (zero past the end); x is (B, T, ...)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


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


def causal_lse(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """log Σ_{s≤t} exp(scale · q_t·k_s), (B, nh, T) float32, with the exact gradient.

    The value is computed without grad in row chunks; the gradient (scale·E_p[k] for q, scale·p·q
    for k) comes from one extra SDPA call with k as the values and detached scores.
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
            s = s.masked_fill(torch.arange(b, device=q.device)[None, :] > rows, float("-inf"))
            lse[..., a:b] = torch.logsumexp(s, dim=-1)
        lse = lse.view(B, nh, T)
    u = F.scaled_dot_product_attention(q.detach(), k.detach(), k, is_causal=True, enable_gqa=rep > 1)  # (B, nh, T, hd)
    surrogate = scale * (q * u).float().sum(-1)  # (B, nh, T)
    return lse + surrogate - surrogate.detach()


def ttt_attention(q, k0, v0, diag_k: list[torch.Tensor], diag_v: list[torch.Tensor]) -> torch.Tensor:
    """Attention of q (B, nh, T, hd) over causal step-0 keys k0/v0 (B, nkv, T, hd) plus, for row t,
    the diagonal keys diag_k[j][:, :, t] (one per step 1..k). Returns (B, nh, T, hd)."""
    nh, nkv = q.shape[1], k0.shape[1]
    gqa = nh != nkv
    causal = F.scaled_dot_product_attention(q, k0, v0, is_causal=True, enable_gqa=gqa)  # (B, nh, T, hd)
    if not diag_k:
        return causal
    scale = q.shape[-1] ** -0.5

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(nh // nkv, dim=1) if gqa else x  # (B, nkv, T, hd) -> (B, nh, T, hd)

    lse = causal_lse(q, k0, scale)  # (B, nh, T)
    d = torch.stack([scale * (q * heads(kj)).float().sum(-1) for kj in diag_k])  # (k, B, nh, T)
    m = torch.maximum(lse, d.max(0).values).detach()  # (B, nh, T)
    w_c, w_d = (lse - m).exp(), (d - m).exp()  # (B, nh, T), (k, B, nh, T)
    z = w_c + w_d.sum(0)
    # mix in the activation dtype (weights from fp32), so autograd keeps no fp32 copy of any value tensor
    out = (w_c / z).to(q.dtype)[..., None] * causal
    for wj, vj in zip(w_d, diag_v):
        out = out + (wj / z).to(q.dtype)[..., None] * heads(vj)
    return out


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
    target_argmax = batch["topk_ids"][..., 0].long()  # (B, T) the target's greedy next token, over token t+1
    if target_head is not None:
        with torch.no_grad():
            p_all = torch.softmax((batch["last_hidden"].to(target_head.dtype) @ target_head.t()).float(), -1)  # (B, T, Vd)
        ids_all, has_mass = None, torch.ones_like(loss_mask)
    else:
        ids_all, p_all, has_mass = topk_to_draft(batch["topk_ids"], batch["topk_logprobs"], target_to_draft_map(model.d2t, model.config.vocab_size))

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
            stats[:, k] = torch.stack([step_loss.detach(), match.sum(), n, (chain_valid & match).sum(), chain_valid.sum()]).float()
            chain_ok = chain_valid & match
        hidden = out
    return TTTOutput(loss, *stats)


class TTTObjective(torch.nn.Module):
    """The drafter plus its TTT loss as one module, so that a distributed engine runs `forward(batch)`."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float, target_head: torch.Tensor | None = None) -> None:
        super().__init__()
        self.drafter, self.steps, self.decay = drafter, steps, decay
        self.register_buffer("target_head", target_head, persistent=False)  # (Vd, Ht) or None

    def forward(self, batch: dict[str, torch.Tensor]) -> TTTOutput:
        return ttt_forward(self.drafter, batch, self.steps, self.decay, self.target_head)
