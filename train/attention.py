"""Attention of the TTT unroll: step k's query at row t sees the step-0 causal keys plus the row's own key of every
earlier step (the diagonal keys). One causal flash call gives the causal part and its log-sum-exp; the diagonal
keys are merged with it in fp32 weights, and the backward hands the merged output back to the flash backward
(`ttt_attention`). The "lse" path (`lse_attention`) does the same through causal SDPA and `causal_lse`.

Packed rows (`Documents`) keep attention inside each document: varlen flash on CUDA, a block-diagonal mask elsewhere.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# "flash": _FlashTTTAttention where the flash kernel runs; "lse": causal SDPA + causal_lse (the env var picks it per
# job)
ATTENTION = os.environ.get("EAGLE3FT_TTT_ATTENTION", "flash")
LSE_CHUNK = 256  # query rows per chunk when computing the causal log-sum-exp ("lse" path)
MERGE_COMPILE = True  # False: the flash path's diagonal merge stays eager under train.compile too (a benchmark knob)


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t + n] at row t (zero past the end); x is (B, T, ...)."""
    if n == 0:
        return x
    pad = torch.zeros_like(x[:, :n])
    return torch.cat([x[:, n:], pad], dim=1)


class Documents:
    """Packed rows (train/batching.py): each row holds whole documents back to back, positions restarting at 0.

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
                    f"varlen flash returned a log-sum-exp of shape {tuple(lse.shape)}, not (heads, tokens) = "
                    f"{(nh, B * T)}; set eagle3ft.train.attention.ATTENTION = 'lse'"
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


def _merge_forward(out_c, lse_c, q, diag_k, diag_v, scale: float):
    """The diagonal keys merged into the causal part (out_c, lse_c), in float32.

    Returns (out (B, nh, T, hd) in q's dtype, lse (B, nh, T) and the diagonal scores s (n, B, nh, T), float32)."""
    qf = q.float()
    s = torch.stack([(qf * kj.float()).sum(-1) for kj in diag_k]) * scale  # (n, B, nh, T)
    lse = torch.logaddexp(lse_c, torch.logsumexp(s, 0))  # (B, nh, T)
    out = out_c.float() * (lse_c - lse).exp()[..., None]  # (B, nh, T, hd)
    for sj, vj in zip(s, diag_v):
        out = out + (sj - lse).exp()[..., None] * vj.float()
    return out.to(q.dtype), lse, s


def _merge_backward(g, out, lse, s, q, diag_k, diag_v, dq, scale: float):
    """The diagonal keys' part of the backward, in float32: (dq (B, nh, T, hd): the flash backward's dq plus the
    diagonal terms, dk_j, dv_j), each in q's dtype."""
    gf = g.float()
    D = (gf * out.float()).sum(-1)  # (B, nh, T) rowsum(dout · out) of the merged softmax
    dq = dq.float()
    dks, dvs = [], []
    for sj, kj, vj in zip(s, diag_k, diag_v):
        pj = (sj - lse).exp()  # (B, nh, T)
        ds = pj * ((gf * vj.float()).sum(-1) - D) * scale  # (B, nh, T)
        dq = dq + ds[..., None] * kj.float()
        dks.append((ds[..., None] * q.float()).to(q.dtype))
        dvs.append((pj[..., None] * gf).to(q.dtype))
    return dq.to(q.dtype), dks, dvs


_COMPILED_MERGE: dict[str, object] = {}  # "forward" / "backward" -> the compiled function, built on first use


def _compiled(fn):
    """torch.compile'd fn, one graph per number of diagonal keys, the token count dynamic (T varies between batches;
    without it each new T would recompile until dynamo's cache limit sends the rest to eager)."""
    compiled = torch.compile(fn)

    def call(*args):
        T = args[0].shape[2]  # both take a (B, nh, T, hd) tensor first
        for x in args:
            for t in x if isinstance(x, list) else (x,):
                if isinstance(t, torch.Tensor):
                    for d in range(1, t.dim()):
                        if t.shape[d] == T:
                            torch._dynamo.maybe_mark_dynamic(t, d)
        return compiled(*args)

    return call


def _merge_fns(compiled: bool):
    if not (compiled and MERGE_COMPILE):
        return _merge_forward, _merge_backward
    if not _COMPILED_MERGE:
        _COMPILED_MERGE.update(forward=_compiled(_merge_forward), backward=_compiled(_merge_backward))
    return _COMPILED_MERGE["forward"], _COMPILED_MERGE["backward"]


class _FlashTTTAttention(torch.autograd.Function):
    """ttt_attention for nh == nkv in one flash call plus O(k·T·hd) elementwise work.

    Forward: flash gives the causal output o_c and lse_c; the diagonal scores s_j = scale q·k_j are merged,
    lse = logaddexp(lse_c, logsumexp_j s_j), out = exp(lse_c - lse) o_c + Σ_j exp(s_j - lse) v_j.
    Backward: the flash backward given (out, lse) of the whole key set yields the exact causal-key gradients
    (its probabilities exp(s - lse) and D = rowsum(dout · out) are those of the merged softmax); the diagonal
    keys add p_j = exp(s_j - lse): dv_j = p_j dout, ds_j = p_j (dout·v_j - D), dq += scale ds_j k_j,
    dk_j = scale ds_j q. With `compiled` (train.compile) the merge and its backward run through torch.compile,
    a few fused kernels per step instead of ~10 elementwise ones per diagonal key.
    """

    @staticmethod
    def forward(ctx, docs, compiled, q, k0, v0, *diag):
        n = len(diag) // 2
        diag_k, diag_v = diag[:n], diag[n:]
        scale = q.shape[-1] ** -0.5
        out, lse_c, extra = _flash_forward(q, k0, v0, scale, docs)  # (B, nh, T, hd), (B, nh, T)
        lse_c = lse_c[..., : q.shape[2]]
        if n:
            merge, _ = _merge_fns(compiled)
            out, lse, s = merge(out, lse_c.contiguous(), q, list(diag_k), list(diag_v), scale)
        else:  # step 0 of a packed batch: the document-causal part alone
            s, lse = lse_c.new_empty(0), lse_c.contiguous()
        ctx.save_for_backward(q, k0, v0, out, lse, s, *diag)
        ctx.extra, ctx.scale, ctx.n, ctx.docs, ctx.compiled = extra, scale, n, docs, compiled
        return out

    @staticmethod
    def backward(ctx, g):
        q, k0, v0, out, lse, s, *diag = ctx.saved_tensors
        diag_k, diag_v = diag[: ctx.n], diag[ctx.n :]
        if g.stride(-1) != 1:
            g = g.contiguous()
        dq, dk0, dv0 = _flash_backward(g, q, k0, v0, out, lse, ctx.extra, ctx.scale, ctx.docs)
        dks, dvs = [], []
        if ctx.n:
            _, merge_backward = _merge_fns(ctx.compiled)
            dq, dks, dvs = merge_backward(g, out, lse, s, q, list(diag_k), list(diag_v), dq, ctx.scale)
        return None, None, dq, dk0, dv0, *dks, *dvs


def _flash_ok(q: torch.Tensor) -> bool:
    if ATTENTION != "flash" or q.shape[-1] % 8 or q.shape[-1] > 256:
        return False
    return q.device.type == "cpu" or (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16))


def _heads(x: torch.Tensor, nh: int) -> torch.Tensor:
    return x.repeat_interleave(nh // x.shape[1], dim=1) if x.shape[1] != nh else x  # (B, nkv, T, hd) -> (B, nh, T, hd)


def ttt_attention(
    q,
    k0,
    v0,
    diag_k: list[torch.Tensor],
    diag_v: list[torch.Tensor],
    docs: Documents | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Attention of q (B, nh, T, hd) over causal step-0 keys k0/v0 (B, nkv, T, hd) plus, for row t,
    the diagonal keys diag_k[j][:, :, t] (one per step 1..k). Returns (B, nh, T, hd).
    With docs (packed rows) the step-0 keys are those of row t's own document only. `compiled` (train.compile):
    the flash path's diagonal merge runs through torch.compile."""
    if (diag_k or docs is not None) and _flash_ok(q):
        nh = q.shape[1]
        return _FlashTTTAttention.apply(docs, compiled, q, *(_heads(x, nh) for x in (k0, v0, *diag_k, *diag_v)))
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
