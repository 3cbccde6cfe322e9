"""The EAGLE-3 drafter in SGLang's ``LlamaForCausalLMEagle3`` layout.

Parameter names are SGLang's checkpoint keys (``fc.weight``, ``midlayer.*``, ``norm.weight``,
``lm_head.weight``, buffers ``d2t``/``t2d``; a deeper drafter's layers 1.. as ``layers.{i}.*``), so ``state_dict()``
minus ``embed_tokens`` is the exported checkpoint. No I/O, no distributed code: training (train/ttt.py) and inference
(eval/decode/speculate.py) both drive the same pieces. Its config.json is config.py's
DrafterConfig; building the model refuses a layout it cannot build (DrafterConfig.check_supported).

Shapes: B batch, T new tokens, S cached tokens, H drafter hidden, Ht target hidden,
nh / nkv attention / key-value heads, hd head dim, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from eagle3ft.drafter import wgrad
from eagle3ft.drafter.config import DrafterConfig

# --------------------------------------------------------------------------- building blocks


class Linear(nn.Linear):
    """nn.Linear without bias whose weight gradient the TTT unroll may take in one GEMM over its steps
    (wgrad.py); the same parameter and checkpoint key as nn.Linear."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return wgrad.linear(x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: DrafterConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq (hd/2,), attention scale on cos/sin) for the config's rope type."""
    dim, base = cfg.head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return inv_freq.float(), 1.0
    factor = float(rs["factor"])
    if kind == "linear":
        return (inv_freq / factor).float(), 1.0
    if kind == "llama3":
        low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_len = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled).float(), 1.0
    # yarn
    old_len = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo if hi != lo else 1e-3)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 keeps the original frequency (high frequencies)
    inv = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    return inv.float(), float(attention_factor)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (B, heads, T, hd); cos/sin (B, T, hd)
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H concatenation [input_layernorm(emb), hidden_norm(h)] (the midlayer), or
    H (`d_in`, a deeper drafter's layers above it)."""

    def __init__(self, cfg: DrafterConfig, d_in: int | None = None) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d_in = d_in or 2 * cfg.hidden_size
        self.q_proj = Linear(d_in, self.nh * self.hd)
        self.k_proj = Linear(d_in, self.nkv * self.hd)
        self.v_proj = Linear(d_in, self.nkv * self.hd)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Roped q (B, nh, T, hd), k and v (B, nkv, T, hd); the attention core is the caller's."""
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)  # x (B, T, d_in)

    def heads(self, q, k, v, cos, sin):
        """The projections (B, T, heads·hd) split into heads (B, heads, T, hd), q and k roped (compiled in training)."""
        B, T, _ = q.shape
        q = q.view(B, T, self.nh, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = o.shape  # o (B, nh, T, hd)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))  # (B, T, H)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))  # (B, T, H) -> (B, T, I) -> (B, T, H)

    @staticmethod
    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up  # (B, T, I), compiled in training


class MidLayer(nn.Module):
    """SGLang's Eagle3 LlamaDecoderLayer, split at the attention core so TTT can supply its own."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attention_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # emb, hidden (B, T, H) -> (B, T, 2H)
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        # attn (B, nh, T, hd) attention output; residual (B, T, H) the un-normed input hidden
        h = residual + self.self_attn.out(attn)  # (B, T, H)
        return h + self.mlp(self.post_attention_layernorm(h))  # (B, T, H), pre-norm output


class UpperLayer(nn.Module):
    """Layer i >= 1 of a deeper drafter: SGLang's Eagle3 LlamaDecoderLayer with is_input_layer False, a pre-norm Llama
    layer over the layer below's pre-norm output whose input norm is `hidden_norm` (q/k/v read H). SGLang also builds
    an `input_layernorm` there that its forward never reads, and vLLM reads that one instead of hidden_norm: the
    export writes hidden_norm under both names (export.py: vllm_norm_copies)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, d_in=cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self.self_attn(self.hidden_norm(h), cos, sin)  # h (B, T, H) -> q (B, nh, T, hd), k/v (B, nkv, T, hd)

    finish = MidLayer.finish  # residual + o_proj(attn), then the MLP: (B, T, H) pre-norm

    def start_as_identity(self) -> None:
        """o_proj and down_proj zero: the layer passes its input through, so one added to a trained drafter keeps
        that drafter's outputs until training moves it."""
        with torch.no_grad():
            self.self_attn.o_proj.weight.zero_()
            self.mlp.down_proj.weight.zero_()


class LMHead(nn.Linear):
    """Linear(H -> Vd), no bias. `head(x, fn)` returns fn(x, weight) from inside the module call (training's
    fused chunked loss), so an engine that shards parameters (ZeRO-3) gathers the weight for it."""

    def __init__(self, hidden_size: int, draft_vocab_size: int) -> None:
        super().__init__(hidden_size, draft_vocab_size, bias=False)

    def forward(self, x: torch.Tensor, fn=None):
        return super().forward(x) if fn is None else fn(x, self.weight)


class DraftCache:
    """The drafter's key/value cache for inference: (B, nkv, rows, hd) each, the first `length` rows filled by `step`;
    a deeper drafter's layers 1.. keep theirs in `above`, over the same rows. One interface (`length`, `append`,
    `crop`, `layer`), two storages:

    - DraftCache() grows: each append makes the tensor of the rows so far (eager decoding, the offline evaluation);
      DraftCache(k, v) starts from rows that another cache holds;
    - DraftCache.static(cfg, capacity, device, dtype) holds buffers of `capacity` rows written in place, so that a
      CUDA graph can read and write them (eval/decode/draft_graph.py); setting `length` marks rows written there
      directly.
    """

    def __init__(self, k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> None:
        self.k, self.v = k, v
        self.capacity: int | None = None  # None: the cache grows
        self._length = 0 if k is None else k.shape[2]
        self.above: list[DraftCache] = []

    @classmethod
    def static(
        cls, cfg: DrafterConfig, capacity: int, device, dtype: torch.dtype, batch: int = 1, layers: int | None = None
    ) -> "DraftCache":
        shape = (batch, cfg.num_key_value_heads, capacity, cfg.head_dim)
        c = cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
        c.capacity, c._length = capacity, 0
        n = cfg.num_hidden_layers if layers is None else layers
        c.above = [cls.static(cfg, capacity, device, dtype, batch, layers=1) for _ in range(n - 1)]
        return c

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        """Keep the first n rows (a static cache: up to its capacity, rows written in place count), every layer's."""
        most = self._length if self.capacity is None else self.capacity
        if not 0 <= n <= most:
            raise ValueError(f"a draft cache of {most} rows cannot hold {n}")
        if self.capacity is None and self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]
        self._length = n
        for c in self.above:
            c.length = n

    def layer(self, i: int) -> "DraftCache":
        """Layer i's cache: this one for the midlayer (i = 0), else `above[i - 1]` (made on first use when growing)."""
        while self.capacity is None and len(self.above) < i:
            self.above.append(DraftCache())
        return self if i == 0 else self.above[i - 1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values of T new tokens (B, nkv, T, hd) after the rows so far -> all its rows."""
        start, end = self._length, self._length + k.shape[2]
        if self.capacity is None:
            self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
            self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        elif end > self.capacity:
            raise ValueError(f"a static draft cache of {self.capacity} rows cannot hold {end}")
        else:
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
        self._length = end  # this layer's alone: `step` appends each layer's in turn
        return self.k[:, :, :end], self.v[:, :, :end]

    def crop(self, n: int) -> None:
        """Roll back to the first n rows (a static cache's buffers keep the rest, to be overwritten)."""
        if not 0 <= n <= self._length:
            raise ValueError(f"cannot crop a cache of {self._length} entries to {n}")
        self.length = n


class Eagle3Drafter(nn.Module):
    """embed_tokens (frozen target embedding) -> fc fuses 3 aux states -> midlayer (-> layers 1.. of a deeper drafter)
    -> norm -> lm_head over the draft vocab.

    EAGLE-3.1 options (config.json flags SGLang reads): `fc_norm` adds `fc_norm.{0,1,2}` RMSNorms, one per aux chunk,
    before fc; `norm_output` feeds the next draft step norm(out) instead of the pre-norm out. Both off: EAGLE-3.
    """

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg.check_supported()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # the target's, frozen (as SGLang: H wide)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc_norm = (
            nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3)])
            if cfg.fc_norm
            else None
        )
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = self.make_midlayer(cfg)
        # num_hidden_layers > 1: SGLang's layers.1.. (keys `layers.{i}.*`), each over the one below's pre-norm output
        self.layers = nn.ModuleDict({str(i): UpperLayer(cfg) for i in range(1, cfg.num_hidden_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.hidden_size, cfg.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # target = draft + d2t[draft]
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # target id is in the draft vocab
        # (hd/2,) float32, kept off the buffers so that casting the module to bf16 cannot round it
        self.inv_freq, self.rope_scale = self.rope_frequencies(cfg)
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}  # inv_freq copied once per device
        self.blocks_compiled = False  # compile_blocks() ran (train.compile)

    # -- what a layout with another attention replaces (model_mla.py)

    @staticmethod
    def make_midlayer(cfg: DrafterConfig) -> nn.Module:
        return MidLayer(cfg)

    @staticmethod
    def rope_frequencies(cfg: DrafterConfig) -> tuple[torch.Tensor, float]:
        return rope_inv_freq(cfg)

    # -- pieces shared by training and inference

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        if self.fc_norm is not None:  # each aux layer's (B, T, Ht) chunk normed on its own
            aux_hidden = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux_hidden.chunk(3, dim=-1))], dim=-1)
        return self.fc(aux_hidden)  # (B, T, 3Ht) -> (B, T, H)

    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._inv_freq_on.get(position_ids.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[position_ids.device] = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq  # (B, T, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, hd)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def qkv(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor):
        """Roped q (B, nh, T, hd), k and v (B, nkv, T, hd) for tokens `input_ids` (B, T) and hidden (B, T, H)."""
        emb = self.embed_tokens(input_ids).to(hidden.dtype)  # (B, T, H)
        x = self.midlayer.attention_input(emb, hidden)  # (B, T, 2H)
        cos, sin = self.rope(position_ids, x.dtype)
        return self.midlayer.self_attn(x, cos, sin)

    def upper(self, out: torch.Tensor, position_ids: torch.Tensor, attend) -> torch.Tensor:
        """Layers 1.. of a deeper drafter over the midlayer's pre-norm output `out` (B, T, H) -> (B, T, H) pre-norm;
        `out` itself for one layer. attend(i, q, k, v) -> (B, nh, T, hd) is the caller's attention core for layer i
        (an inference cache, the TTT unroll's keys)."""
        if not self.layers:
            return out
        cos, sin = self.rope(position_ids, out.dtype)
        for i, layer in enumerate(self.layers.values(), 1):
            out = layer.finish(attend(i, *layer.qkv(out, cos, sin)), out)
        return out

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden_out))  # (B, T, H) -> (B, T, Vd)

    def feedback(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """The hidden state the next draft step reads: the pre-norm output, or norm(out) with norm_output."""
        return self.norm(hidden_out) if self.config.norm_output else hidden_out  # (B, T, H)

    def outputs(self, hidden_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(feedback (B, T, H), logits (B, T, Vd)) of one forward's pre-norm output, the norm computed once."""
        normed = self.norm(hidden_out)
        return (normed if self.config.norm_output else hidden_out), self.lm_head(normed)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def compile_blocks(self) -> None:
        """torch.compile the elementwise-heavy pieces in place: the RMSNorms, the split into heads with rope, SwiGLU.

        The projections stay outside the compiled graphs, so that the TTT unroll can defer their weight gradients
        (wgrad.py); the unroll and the attention core stay eager too (the TTT attention compiles its own merge).
        Needs a backend that compiles (triton on CUDA).
        """
        mid = self.midlayer
        self.blocks_compiled = True
        for m in (self.norm, mid.input_layernorm, *(self.fc_norm or ())):
            m.compile()
        for layer in (mid, *self.layers.values()):
            layer.hidden_norm.compile()
            layer.post_attention_layernorm.compile()
            layer.self_attn.heads = torch.compile(layer.self_attn.heads)
            layer.mlp.act = torch.compile(layer.mlp.act)

    # -- inference

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DraftCache,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward over T new tokens; appends their keys/values to `cache`.

        input_ids (B, T), hidden (B, T, H) (fused target features or the drafter's own previous
        output), position_ids (B, T); attn_mask bool (B, 1, T, S + T), True = attend (default:
        all of the cache plus causal among the new tokens).
        Returns (hidden for the next step (B, T, H): `feedback(out)`, logits (B, T, Vd)).
        """
        past, T = cache.length, input_ids.shape[1]
        if attn_mask is None and T > 1:
            attn_mask = torch.ones(T, past + T, dtype=torch.bool, device=input_ids.device).tril(diagonal=past)
            attn_mask = attn_mask[None, None]
        gqa = self.config.num_key_value_heads != self.config.num_attention_heads

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k, v = cache.layer(i).append(k, v)  # (B, nkv, S + T, hd)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)  # (B, nh, T, hd)

        out = self.midlayer.finish(attend(0, *self.qkv(input_ids, hidden, position_ids)), hidden)  # (B, T, H) pre-norm
        return self.outputs(self.upper(out, position_ids, attend))


def export_keys(fc_norm: bool = False, num_layers: int = 1) -> list[str]:
    """The checkpoint keys SGLang's LlamaForCausalLMEagle3.load_weights maps onto parameters, plus d2t/t2d.

    fc_norm (EAGLE-3.1) adds `fc_norm.{0,1,2}.weight`, which SGLang loads into `model.fc_norm.{i}.weight`; each layer
    past the midlayer adds `layers.{i}.*`, its `input_layernorm` a copy of its `hidden_norm` (export.py:
    vllm_norm_copies).
    """
    norms = ["input_layernorm", "hidden_norm", "post_attention_layernorm"]

    def layer(prefix: str) -> list[str]:
        return (
            [f"{prefix}.{n}.weight" for n in norms]
            + [f"{prefix}.self_attn.{p}_proj.weight" for p in "qkvo"]
            + [f"{prefix}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        )

    return (
        [f"fc_norm.{i}.weight" for i in range(3) if fc_norm]
        + ["fc.weight"]
        + layer("midlayer")
        + [k for i in range(1, num_layers) for k in layer(f"layers.{i}")]
        + ["norm.weight", "lm_head.weight", "d2t", "t2d"]
    )
