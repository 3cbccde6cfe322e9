"""SGLang 0.5.17's Eagle3DeepseekV2ForCausalLM, reimplemented from its sources for tests/test_train_model_mla.py: the
parameters its loader takes and how it fills them, and its forward with MLA in the absorbed form."""

import math
import re

import torch
import torch.nn.functional as F

from eagle3ft.drafter.config import DrafterConfig

# --------------------------------------------------------------------------- SGLang's loader, reimplemented


def sglang_params(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Eagle3DeepseekV2ForCausalLM.named_parameters() minus embed_tokens, with shapes: kimi_k25_eagle3.py 176-250
    (model.fc, model.fc_norm, model.midlayer, model.norm), 315-321 (lm_head), 106-145 (the 2H fused_qkv_a
    replacement, mlp, norms) and deepseek_v2.py 1786-1880 (q_a_layernorm, q_b_proj, kv_b_proj, o_proj,
    kv_a_layernorm of DeepseekV2AttentionMLA with q_lora_rank set)."""
    e, H, I, nh = cfg.extra, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    ql, r, dn, dr, dv = (
        e["q_lora_rank"],
        e["kv_lora_rank"],
        e["qk_nope_head_dim"],
        e["qk_rope_head_dim"],
        e["v_head_dim"],
    )
    a = "model.midlayer.self_attn."
    p = {
        "model.fc.weight": (H, 3 * cfg.target_hidden_size),
        a + "fused_qkv_a_proj_with_mqa.weight": (ql + r + dr, 2 * H),
        a + "q_a_layernorm.weight": (ql,),
        a + "q_b_proj.weight": (nh * (dn + dr), ql),
        a + "kv_a_layernorm.weight": (r,),
        a + "kv_b_proj.weight": (nh * (dn + dv), r),
        a + "o_proj.weight": (H, nh * dv),
        "model.midlayer.mlp.gate_up_proj.weight": (2 * I, H),
        "model.midlayer.mlp.down_proj.weight": (H, I),
        "model.midlayer.input_layernorm.weight": (H,),
        "model.midlayer.hidden_norm.weight": (H,),
        "model.midlayer.post_attention_layernorm.weight": (H,),
        "model.norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
    }
    if cfg.fc_norm:
        p.update({f"model.fc_norm.{i}.weight": (cfg.target_hidden_size,) for i in range(3)})
    return p


def sglang_load(cfg: DrafterConfig, weights: dict[str, torch.Tensor]):
    """Eagle3DeepseekV2ForCausalLM.load_weights (kimi_k25_eagle3.py 425-498) over `weights`: (the parameters it
    filled, the names it skipped, hot_token_id). gate/up stack into gate_up_proj (427-430, 451-462), q_a_proj and
    kv_a_proj_with_mqa are cached and concatenated q-first into fused_qkv_a_proj_with_mqa (464-489)."""
    params, filled, skipped, cached, hot = sglang_params(cfg), {}, [], {}, None
    gate_up: dict[str, dict[int, torch.Tensor]] = {}
    for name, w in weights.items():
        if name == "d2t" or name.endswith(".d2t"):
            hot = w + torch.arange(w.shape[0])
            continue
        if name == "t2d" or name.endswith(".t2d"):
            continue
        mapped = re.sub(r"^layers\.0\.", "midlayer.", name)
        if not mapped.startswith("lm_head."):
            mapped = f"model.{mapped}"
        stacked = [(p, s) for p, s in ((".gate_proj", 0), (".up_proj", 1)) if p in mapped]
        if stacked and mapped.replace(stacked[0][0], ".gate_up_proj") in params:
            gate_up.setdefault(mapped.replace(stacked[0][0], ".gate_up_proj"), {})[stacked[0][1]] = w
            continue
        if "q_a_proj" in mapped or "kv_a_proj_with_mqa" in mapped:
            cached[mapped] = w
            q = mapped if "q_a_proj" in mapped else mapped.replace("kv_a_proj_with_mqa", "q_a_proj")
            kv = mapped if "kv_a_proj_with_mqa" in mapped else mapped.replace("q_a_proj", "kv_a_proj_with_mqa")
            if q in cached and kv in cached:
                fused = q.replace("q_a_proj", "fused_qkv_a_proj_with_mqa")
                if fused in params:
                    filled[fused] = torch.cat([cached.pop(q), cached.pop(kv)], dim=0)
            continue
        if mapped not in params:
            skipped.append(name)
            continue
        filled[mapped] = w
    for name, shards in gate_up.items():
        if set(shards) == {0, 1}:
            filled[name] = torch.cat([shards[0], shards[1]], dim=0)
    for name, w in filled.items():
        assert tuple(w.shape) == params[name], (name, tuple(w.shape), params[name])
    return filled, skipped, hot


# --------------------------------------------------------------------------- SGLang's forward, reimplemented


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def sglang_rope(cfg: DrafterConfig, pos):
    """(cos, sin (T, 1, dr/2), softmax scale) of SGLang's MLA rope: plain, or deepseek_yarn for any rope_scaling
    (deepseek_v2.py 1781-1898; DeepseekScalingRotaryEmbedding, rope_variant.py 340-410; yarn.py 26-62;
    compute_mla_mscale_scaling, configs/model_config.py 1961-1985), in float32 as there."""
    dr, dn, base, rs = cfg.extra["qk_rope_head_dim"], cfg.extra["qk_nope_head_dim"], cfg.rope_theta, cfg.rope_scaling
    pos_freqs = base ** (torch.arange(0, dr, 2, dtype=torch.float) / dr)
    inv, mscale, scale = 1.0 / pos_freqs, 1.0, (dn + dr) ** -0.5
    if rs:
        f, old = rs["factor"], rs["original_max_position_embeddings"]

        def dim(rot):
            return (dr * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = (
            max(math.floor(dim(rs.get("beta_fast", 32))), 0),
            min(math.ceil(dim(rs.get("beta_slow", 1))), dr - 1),
        )
        high = high + 0.001 if low == high else high
        mask = 1 - torch.clamp((torch.arange(dr // 2, dtype=torch.float) - low) / (high - low), 0, 1)
        inv = 1.0 / (f * pos_freqs) * (1 - mask) + 1.0 / pos_freqs * mask

        def get_mscale(s, m):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        mscale = get_mscale(f, rs.get("mscale", 1)) / get_mscale(f, rs.get("mscale_all_dim", 0))
        scale = scale * get_mscale(f, rs.get("mscale_all_dim", False)) ** 2
    freqs = pos[:, None].float() * inv  # (T, dr/2)
    return (freqs.cos() * mscale)[:, None], (freqs.sin() * mscale)[:, None], scale


def gptj_rope(x, cos, sin):
    """SGLang's apply_rotary_emb with is_neox_style False (layers/rotary_embedding/utils.py 36-63): pairs (2i, 2i+1)."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def sglang_forward(cfg: DrafterConfig, p: dict, emb, h, pos):
    """Eagle3MLADecoderLayer + final norm (kimi_k25_eagle3.py 154-190, 265-277) with MLA in SGLang's absorbed form
    (w_kc/w_vc split of kv_b_proj as post_load_weights, 500-517; scores over the latent plus the shared k_pe; scale
    (dn + dr)^-0.5): emb, h (T, H) -> (pre-norm out (T, H), logits (T, Vd))."""
    e, eps, nh = cfg.extra, cfg.rms_norm_eps, cfg.num_attention_heads
    ql, r, dn, dr, dv = (
        e["q_lora_rank"],
        e["kv_lora_rank"],
        e["qk_nope_head_dim"],
        e["qk_rope_head_dim"],
        e["v_head_dim"],
    )
    a = "model.midlayer.self_attn."
    x = torch.cat(
        [
            rms(emb, p["model.midlayer.input_layernorm.weight"], eps),
            rms(h, p["model.midlayer.hidden_norm.weight"], eps),
        ],
        -1,
    )
    q_lat, latent, k_pe = (x @ p[a + "fused_qkv_a_proj_with_mqa.weight"].t()).split([ql, r, dr], -1)
    q = (rms(q_lat, p[a + "q_a_layernorm.weight"], eps) @ p[a + "q_b_proj.weight"].t()).view(-1, nh, dn + dr)
    q_nope, q_pe = q.split([dn, dr], -1)  # (T, nh, dn), (T, nh, dr)
    latent = rms(latent, p[a + "kv_a_layernorm.weight"], eps)  # (T, r): the cached latent
    w_kc, w_vc = (
        p[a + "kv_b_proj.weight"].unflatten(0, (nh, dn + dv)).split([dn, dv], dim=1)
    )  # (nh, dn, r), (nh, dv, r)
    q_abs = torch.einsum("thd,hdr->thr", q_nope, w_kc)  # (T, nh, r)
    cos, sin, scale = sglang_rope(cfg, pos)
    q_pe, k_pe = gptj_rope(q_pe, cos, sin), gptj_rope(k_pe[:, None], cos, sin)[:, 0]
    s = (torch.einsum("thr,sr->hts", q_abs, latent) + torch.einsum("thd,sd->hts", q_pe, k_pe)) * scale
    T = x.shape[0]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)  # (nh, T, T)
    o = torch.einsum("hvr,htr->thv", w_vc, torch.einsum("hts,sr->htr", s, latent))  # (T, nh, dv)
    residual = h + o.reshape(T, nh * dv) @ p[a + "o_proj.weight"].t()
    gate, up = (
        rms(residual, p["model.midlayer.post_attention_layernorm.weight"], eps)
        @ p["model.midlayer.mlp.gate_up_proj.weight"].t()
    ).chunk(2, -1)
    out = residual + (F.silu(gate) * up) @ p["model.midlayer.mlp.down_proj.weight"].t()
    return out, rms(out, p["model.norm.weight"], eps) @ p["lm_head.weight"].t()
