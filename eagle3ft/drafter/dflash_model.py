"""The DFlash block drafter as SGLang 0.5.17 runs it (models/dflash.py, speculative/dflash_worker_v2.py).

No embedding and no LM head: block tokens are embedded by the target's embedding and draft hidden states go through
the target's LM head (both passed in, frozen). Per token of context, the target's K layer outputs F (K·h) become
c = hidden_norm(fc(F)) once; every draft layer turns c into context keys and values, K = RoPE(k_norm(W_k c)) and
V = W_v c (no input_layernorm, no query, no MLP on the context). Block tokens run pre-norm Qwen3 layers (per-head q/k
RMSNorm, RoPE, SwiGLU) whose queries attend to the context keys a mask allows and to their own block's keys,
bidirectionally; a final norm ends the draft.

One forward serves inference (one block per request after L committed tokens: the block sees the whole context) and
training (many blocks per sequence, block n anchored at a_n sees context j < a_n only, never another block):
`block_mask` builds both. Parameter names are SGLang's checkpoint names before its q/k/v and gate/up stacking.

Shapes: B batch, S context tokens, N block tokens (all blocks of a row), K features, h hidden, nh / nkv heads, d head
dim, V target vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from eagle3ft.drafter.dflash_config import DFlashConfig

# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """SGLang's RMSNorm (layers/layernorm.py forward_native): in float32, scaled by the weight, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)


def rope_cos_sin(cfg: DFlashConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (..., d/2) in float32 at integer `positions` (...), as SGLang's get_rope builds them for this
    config: RotaryEmbedding or YaRNScalingRotaryEmbedding (layers/rotary_embedding/ base.py, yarn.py)."""
    d, base = cfg.head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float) / d)  # (d/2,)
    inv = 1.0 / pos_freqs
    rs, mscale = cfg.rope_scaling or {}, 1.0
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "yarn":
        factor = float(rs.get("factor", 1.0))
        old = rs.get("original_max_position_embeddings", cfg.max_position_embeddings)

        def dim_of(rot):
            return d * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

        lo, hi = dim_of(rs.get("beta_fast", 32)), dim_of(rs.get("beta_slow", 1))
        if rs.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, d - 1)
        hi = hi + 0.001 if lo == hi else hi
        keep = (1 - ((torch.arange(d // 2, dtype=torch.float) - lo) / (hi - lo)).clamp(0, 1)) * rs.get(
            "extrapolation_factor", 1
        )
        inv = 1.0 / (factor * pos_freqs) * (1 - keep) + inv * keep

        def get_mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        mscale = get_mscale(factor, m) / get_mscale(factor, m_all) if m is not None and m_all is not None else None
        mscale = (mscale if mscale is not None else get_mscale(factor)) * rs.get("attn_factor", 1)
    freqs = positions.float()[..., None] * inv  # (..., d/2)
    return freqs.cos() * mscale, freqs.sin() * mscale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation (SGLang's default for DFlash). x (B, heads, T, d); cos/sin (B, T, d/2) float32."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, self.nh, self.nkv, self.d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, h, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)  # per head
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Roped, k-normed keys and values of x (B, T, h) -> (B, nkv, T, d) each: the context's (x = c, no
        input_layernorm) and the block's (x = the normed block hidden)."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.d)).transpose(1, 2)  # (B, nkv, T, d)
        v = self.v_proj(x).view(B, T, self.nkv, self.d).transpose(1, 2)  # (B, nkv, T, d)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        """x (B, N, h) normed block hidden; ctx_k/ctx_v (B, nkv, S, d); mask (B, N, S + N) bool, True = may attend
        -> (B, N, h)."""
        B, N, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, N, self.nh, self.d)).transpose(1, 2)  # (B, nh, N, d)
        q = apply_rope(q, cos, sin)
        k, v = self.kv(x, cos, sin)  # (B, nkv, N, d)
        k, v = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2)  # (B, nkv, S + N, d)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, nh, S + N, d)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # (B, nh, N, d); scale d^-0.5
        return self.o_proj(o.transpose(1, 2).reshape(B, N, self.nh * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, N, h) -> (B, N, I) -> (B, N, h)


class Layer(nn.Module):
    """A pre-norm Qwen3 decoder layer over the block tokens (SGLang's DFlashDecoderLayer)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)  # (B, N, h)
        return x + self.mlp(self.post_attention_layernorm(x))


# --------------------------------------------------------------------------- masks


def block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Who may attend to what: anchors (B, nb) -> (B, nb·block, S + nb·block) bool over keys [context ‖ blocks].
    The tokens of block n see context j < anchors[b, n] (strictly: the anchor's own target feature does not exist when
    it is drafted) and every token of block n (bidirectionally), never another block. At inference there is one block
    anchored at the committed length, S = L: it sees the whole context. A negative anchor marks a padding block: it
    sees its own block only."""
    B, nb = anchors.shape
    N = nb * block_size
    block_of = torch.arange(N, device=anchors.device) // block_size  # (N,)
    ctx = torch.arange(context_len, device=anchors.device)[None, None] < anchors[:, block_of, None]  # (B, N, S)
    own = (block_of[:, None] == block_of[None, :]).expand(B, N, N)  # (B, N, N)
    return torch.cat([ctx, own], dim=-1)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """RoPE positions of every block token: anchors (B, nb) -> (B, nb·block), a_n + k for k in 0..block-1 (a padding
    block's negative anchor is clamped to 0)."""
    return (anchors.clamp(min=0)[..., None] + torch.arange(block_size, device=anchors.device)).flatten(1)


# --------------------------------------------------------------------------- the drafter


class DFlashDrafter(nn.Module):
    """SGLang's DFlashDraftModel: `layers.*`, `fc`, `hidden_norm`, `norm` (its exported weights, by name)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.num_features * h, h, bias=False)  # (h, K·h)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features (B, S, K·h) concatenated target layer outputs -> c (B, S, h), once per token for every layer."""
        if features.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"DFlash features are {features.shape[-1]} wide, the drafter takes {self.config.num_features} target "
                f"layers of {self.config.hidden_size} ({self.fc.in_features})"
            )
        return self.hidden_norm(self.fc(features))

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's context keys and values: c (B, S, h), positions (B, S) -> [(k, v) (B, nkv, S, d)] * L_d."""
        cos, sin = rope_cos_sin(self.config, positions)
        return [layer.self_attn.kv(c, cos, sin) for layer in self.layers]

    def blocks(
        self,
        noise: torch.Tensor,
        positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """noise (B, N, h) embedded block tokens ([x_a, MASK, ...] per block); positions (B, N); ctx_kv from
        context_kv; mask (B, N, S + N) from block_mask -> draft hidden (B, N, h) after the final norm."""
        cos, sin = rope_cos_sin(self.config, positions)
        x = noise
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def forward(self, features: torch.Tensor, noise: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Every block of a batch in one pass (training, and offline τ with every position an anchor):
        features (B, S, K·h) at context positions 0..S-1; noise (B, nb·block, h); anchors (B, nb) -> (B, nb·block, h).
        """
        B, S, _ = features.shape
        block = self.config.block_size
        ctx_pos = torch.arange(S, device=features.device).expand(B, S)
        ctx_kv = self.context_kv(self.context(features), ctx_pos)
        return self.blocks(noise, block_positions(anchors, block), ctx_kv, block_mask(anchors, S, block))


def noise_ids(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """Block inputs: tokens (B, T), anchors (B, nb) -> (B, nb·block) = [x_a, MASK x (block-1)] per block."""
    ids = torch.full((*anchors.shape, block_size), mask_token_id, dtype=tokens.dtype, device=tokens.device)
    ids[..., 0] = tokens.gather(1, anchors.clamp(min=0))
    return ids.flatten(1)


class DraftContext:
    """The committed tokens' context keys and values per draft layer (SGLang's draft KV cache) for a batch of requests
    of equal committed length: `append` the features of newly committed tokens, `draft` a block after them."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter = drafter
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # [(k, v) (B, nkv, L, d)] per layer
        self.length = 0  # L, the committed tokens

    @torch.no_grad()
    def append(self, features: torch.Tensor) -> None:
        """features (B, n, K·h) of the next n committed tokens (positions L..L+n-1): the prefill's prompt rows, or a
        verify's first commit rows."""
        B, n, _ = features.shape
        positions = torch.arange(self.length, self.length + n, device=features.device).expand(B, n)
        new = self.drafter.context_kv(self.drafter.context(features), positions)
        if self.kv is None:
            self.kv = new
        else:
            self.kv = [(torch.cat([k, nk], 2), torch.cat([v, nv], 2)) for (k, v), (nk, nv) in zip(self.kv, new)]
        self.length += n

    @torch.no_grad()
    def draft(self, bonus: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """bonus (B,) the token at position L; embed, lm_head (V, h) the target's -> draft tokens (B, block - 1): the
        argmax of the target head at block positions 1..block-1 (position 0, the bonus, is dropped)."""
        cfg = self.drafter.config
        if cfg.mask_token_id is None:
            raise ValueError(f"{cfg.path}: drafting needs dflash_config.mask_token_id")
        if self.kv is None:
            raise ValueError("a DFlash draft needs the prompt's features first (append)")
        B, L = bonus.shape[0], self.length
        anchors = torch.full((B, 1), L, dtype=torch.long, device=bonus.device)
        ids = torch.full((B, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=bonus.device)
        ids[:, 0] = bonus
        mask = block_mask(anchors, L, cfg.block_size)  # all True: the block sees every committed token
        hidden = self.drafter.blocks(F.embedding(ids, embed), block_positions(anchors, cfg.block_size), self.kv, mask)
        return (hidden[:, 1:] @ lm_head.t()).argmax(-1)  # (B, block - 1)
