"""The EAGLE-3(.1) drafter with DeepSeek-V2 multi-latent attention: SGLang's ``Eagle3DeepseekV2ForCausalLM``.

SGLang 0.5.17 serves it from `models/kimi_k25_eagle3.py` (the layout of lightseekorg's `kimi-k2.5-eagle3-mla`): the
EAGLE-3 layout of model.py (fc over the aux states, one midlayer reading [input_layernorm(emb),
hidden_norm(h)] (2H), norm, lm_head over the draft vocab, d2t/t2d, EAGLE-3.1's fc_norm and norm_output) with the
midlayer's attention replaced by DeepSeek-V2 MLA whose down projections read the 2H input:

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))                 (B, T, nh·(dn + dr))
    latent, k_pe = kv_a_proj_with_mqa(x).split([r, dr])          (B, T, r), (B, T, dr): k_pe shared by all heads
    k_nope, v = kv_b_proj(kv_a_layernorm(latent)).split per head  (B, nh, T, dn), (B, nh, T, dv)
    q_pe, k_pe roped (interleaved pairs unless rope_interleave is false, as SGLang's DeepseekV2AttentionMLA)

Training and the embedded eval compute MLA uncompressed (per-head keys and values, SDPA scale (dn + dr)^-0.5, as
SGLang's); values are zero-padded to dn + dr so that the TTT attention (train/attention.py) and the caches see one
head width, and the padding is cut before o_proj. SGLang itself absorbs kv_b_proj into w_kc/w_vc and caches the
latent. Parameter names are the checkpoint keys SGLang's `load_weights` reads: it fuses `q_a_proj` and
`kv_a_proj_with_mqa` into `fused_qkv_a_proj_with_mqa` and gate/up into `gate_up_proj`; it requires q_lora_rank.
A rope_scaling is DeepSeek's YaRN there, whatever its type (`mla_rope`).

Config keys (config.json, kept in DrafterConfig.extra): kv_lora_rank r, q_lora_rank, qk_nope_head_dim dn,
qk_rope_head_dim dr, v_head_dim dv, rope_interleave (default true). head_dim and num_key_value_heads are taken as
dn + dr and num_attention_heads (SGLang reads neither for this layout).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle3ft.drafter.config import MLA_EAGLE3, DrafterConfig
from eagle3ft.drafter.model import MLP, Eagle3Drafter, Linear, MidLayer, RMSNorm, apply_rope


@dataclass(frozen=True)
class MLADims:
    kv_lora_rank: int  # r
    q_lora_rank: int
    qk_nope_head_dim: int  # dn
    qk_rope_head_dim: int  # dr
    v_head_dim: int  # dv
    rope_interleave: bool = True

    KEYS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

    @classmethod
    def of(cls, cfg: DrafterConfig) -> "MLADims":
        missing = [k for k in cls.KEYS if cfg.extra.get(k) is None]
        if missing:  # SGLang raises on q_lora_rank None too (kimi_k25_eagle3.py, Eagle3MLADecoderLayer)
            raise ValueError(f"{cfg.path}: an {MLA_EAGLE3} drafter config needs {', '.join(missing)}")
        dims = cls(*(int(cfg.extra[k]) for k in cls.KEYS), bool(cfg.extra.get("rope_interleave", True)))
        if dims.v_head_dim > dims.qk_head_dim or dims.qk_rope_head_dim % 2:
            raise ValueError(f"{cfg.path}: MLA dims {dims} (need v_head_dim <= qk head dim, an even rope dim)")
        return dims

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_config(cfg: DrafterConfig) -> DrafterConfig:
    """cfg with head_dim = dn + dr (the uncompressed cache's head width) and one key/value head per query head."""
    dims = MLADims.of(cfg)
    return dataclasses.replace(cfg, head_dim=dims.qk_head_dim, num_key_value_heads=cfg.num_attention_heads)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def mla_rope(cfg: DrafterConfig) -> tuple[torch.Tensor, float, float]:
    """(inv_freq (dr/2,), scale on cos/sin, factor on the attention scores) as SGLang's DeepseekV2AttentionMLA.

    Any rope_scaling is `deepseek_yarn` there (deepseek_v2.py: rope_type overwritten): YaRN frequencies over dr
    (DeepseekScalingRotaryEmbedding), cos/sin times mscale(f, mscale) / mscale(f, mscale_all_dim) · attn_factor, and
    the softmax scale times mscale(f, mscale_all_dim)² (configs/model_config.py's compute_mla_mscale_scaling).
    """
    dr, base = MLADims.of(cfg).qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dr, 2, dtype=torch.float64) / dr)  # (dr/2,)
    rs = cfg.rope_scaling
    if not rs:
        return (1.0 / pos_freqs).float(), 1.0, 1.0
    f = float(rs.get("factor", 1.0))
    old_len = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dr * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(correction_dim(rs.get("beta_fast", 32))), 0)
    hi = min(math.ceil(correction_dim(rs.get("beta_slow", 1))), dr - 1)
    ramp = ((torch.arange(dr // 2, dtype=torch.float64) - lo) / ((hi if hi != lo else hi + 0.001) - lo)).clamp(0, 1)
    keep = (1 - ramp) * rs.get("extrapolation_factor", 1)  # 1: the original (extrapolated) frequency
    inv_freq = (1.0 / (f * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    m_all = float(rs.get("mscale_all_dim", 0) or 0)
    cos_sin = yarn_mscale(f, float(rs.get("mscale", 1))) / yarn_mscale(f, m_all) * rs.get("attn_factor", 1)
    scaled = rs.get("apply_yarn_scaling", True) and rs.get("apply_scale", True)
    return inv_freq.float(), float(cos_sin), yarn_mscale(f, m_all) ** 2 if scaled else 1.0


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., dr) interleaved rope pairs (x0, x1), (x2, x3), ... -> halves [x0, x2, ..., x1, x3, ...] (apply_rope's)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAAttention(nn.Module):
    """DeepSeek-V2 MLA over the 2H input, uncompressed; `forward` and `out` as model.py's Attention."""

    def __init__(self, cfg: DrafterConfig, dims: MLADims) -> None:
        super().__init__()
        self.nh, self.d = cfg.num_attention_heads, dims
        self.score_factor = mla_rope(cfg)[2]  # on q: SDPA's (dn + dr)^-0.5 times YaRN's mscale², as SGLang's
        r, dr, eps = dims.kv_lora_rank, dims.qk_rope_head_dim, cfg.rms_norm_eps
        self.q_a_proj = Linear(2 * cfg.hidden_size, dims.q_lora_rank)
        self.q_a_layernorm = RMSNorm(dims.q_lora_rank, eps)
        self.q_b_proj = Linear(dims.q_lora_rank, self.nh * dims.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(2 * cfg.hidden_size, r + dr)
        self.kv_a_layernorm = RMSNorm(r, eps)
        self.kv_b_proj = Linear(r, self.nh * (dims.qk_nope_head_dim + dims.v_head_dim))
        self.o_proj = Linear(self.nh * dims.v_head_dim, cfg.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Roped q and k (B, nh, T, dn + dr), v zero-padded to (B, nh, T, dn + dr); x (B, T, 2H), cos/sin (B, T, dr)."""
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # (B, T, nh·(dn + dr))
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.d.kv_lora_rank, self.d.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))  # (B, T, r) -> (B, T, nh·(dn + dv))
        return self.heads(q, kv, k_pe, cos, sin)

    def heads(self, q, kv, k_pe, cos, sin):
        """Split into heads, rope the dr parts, pad v (compiled in training)."""
        (B, T, _), d = q.shape, self.d
        q_nope, q_pe = (
            q.view(B, T, self.nh, d.qk_head_dim).transpose(1, 2).split([d.qk_nope_head_dim, d.qk_rope_head_dim], -1)
        )
        kv = kv.view(B, T, self.nh, d.qk_nope_head_dim + d.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=-1)  # (B, nh, T, dn), (B, nh, T, dv)
        k_pe = k_pe[:, None]  # (B, 1, T, dr)
        if d.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q = torch.cat([q_nope, apply_rope(q_pe, cos, sin)], dim=-1)  # (B, nh, T, dn + dr)
        if self.score_factor != 1.0:
            q = q * self.score_factor
        k = torch.cat([k_nope, apply_rope(k_pe, cos, sin).expand(B, self.nh, T, -1)], dim=-1)  # (B, nh, T, dn + dr)
        return q, k, F.pad(v, (0, d.qk_head_dim - d.v_head_dim))  # v (B, nh, T, dn + dr)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = o.shape  # o (B, nh, T, dn + dr), the padding past dv zero
        o = o[..., : self.d.v_head_dim].transpose(1, 2).reshape(B, T, self.nh * self.d.v_head_dim)
        return self.o_proj(o)  # (B, T, H)


class MLAMidLayer(nn.Module):
    """SGLang's Eagle3MLADecoderLayer: model.py's MidLayer with MLA as its self_attn."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, MLADims.of(cfg))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    attention_input = MidLayer.attention_input  # (B, T, H) x2 -> (B, T, 2H)
    finish = MidLayer.finish  # residual + o_proj(attn), then the MLP: (B, T, H) pre-norm


class Eagle3MLADrafter(Eagle3Drafter):
    """Eagle3Drafter (fuse, qkv, step, outputs, feedback: what train/ttt.py and eval use) with the MLA midlayer."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(mla_config(cfg))

    @staticmethod
    def make_midlayer(cfg: DrafterConfig) -> nn.Module:
        return MLAMidLayer(cfg)

    @staticmethod
    def rope_frequencies(cfg: DrafterConfig) -> tuple[torch.Tensor, float]:
        return mla_rope(cfg)[:2]  # (dr/2,), the cos/sin scale

    def compile_blocks(self) -> None:
        super().compile_blocks()
        self.midlayer.self_attn.q_a_layernorm.compile()
        self.midlayer.self_attn.kv_a_layernorm.compile()


def mla_export_keys(fc_norm: bool = False) -> list[str]:
    """The checkpoint keys SGLang's Eagle3DeepseekV2ForCausalLM.load_weights maps onto parameters, plus d2t/t2d."""
    attn = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    mid = ["input_layernorm", "hidden_norm", "post_attention_layernorm"]
    return (
        [f"fc_norm.{i}.weight" for i in range(3) if fc_norm]
        + ["fc.weight"]
        + [f"midlayer.{n}.weight" for n in mid]
        + [f"midlayer.self_attn.{p}.weight" for p in attn]
        + [f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        + ["norm.weight", "lm_head.weight", "d2t", "t2d"]
    )


def new_drafter(cfg: DrafterConfig) -> Eagle3Drafter:
    """The drafter of cfg's layout (architectures[0]): Eagle3MLADrafter for MLA_EAGLE3, else Eagle3Drafter."""
    return Eagle3MLADrafter(cfg) if cfg.architecture == MLA_EAGLE3 else Eagle3Drafter(cfg)
