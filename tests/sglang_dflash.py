"""SGLang 0.5.17's DFlash drafter, reimplemented from its sources for tests/test_dflash_model.py: how it parses the
config, which parameters its loader fills and how, its draft forward over a paged context, and the decode cycle
DFlashWorkerV2 runs (prefill materialisation, block [bonus, MASK...], draft argmax, greedy chain verify, context
update with the committed rows). Plain loops and explicit softmax, float math as SGLang's native paths do it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# --------------------------------------------------------------------------- config parsing and refusals


def sglang_parse(d: dict, target_layers: int, vocab_size: int) -> dict:
    """What SGLang accepts of a DFlash config.json for a target of `target_layers` layers and `vocab_size` tokens:
    parse_dflash_draft_config (dflash_utils.py 449-530), the draft's resolve_target_layer_ids (models/dflash.py
    361-370, dflash_utils.py 417-446), DFlashMLP's activation (models/dflash.py 269-273), the layer types
    (models/dflash.py 46-74) and the worker's mask id check (dflash_worker_v2.py 733-742). Raises ValueError where
    SGLang does; returns the resolved fields."""
    dc = d.get("dflash_config") or {}
    layers = int(d["num_hidden_layers"])
    if layers < 1:
        raise ValueError("DFLASH draft num_hidden_layers must be positive")
    ntl = dc.get("num_target_layers", d.get("num_target_layers"))
    ntl = int(ntl) if ntl is not None else layers
    block = dc.get("block_size", d.get("block_size"))
    if block is not None and int(block) < 1:
        raise ValueError("DFLASH block_size must be positive")
    ids = dc.get("target_layer_ids", d.get("target_layer_ids"))
    if ids is None:
        ids = [ntl // 2] if layers == 1 else [int(round(1 + i * (ntl - 4) / (layers - 1))) for i in range(layers)]
    else:
        if not isinstance(ids, (list, tuple)):
            raise ValueError("DFLASH dflash_config.target_layer_ids must be a list of ints")
        ids = [int(x) for x in ids]
        if not ids:
            raise ValueError("DFLASH dflash_config.target_layer_ids must be non-empty")
        for v in ids:
            if v < 0 or v >= ntl:
                raise ValueError("DFLASH target_layer_ids contains an out-of-range layer id")
    mask_id = dc.get("mask_token_id")
    if mask_id is not None:
        if not isinstance(mask_id, int) or isinstance(mask_id, bool):
            raise ValueError("DFLASH dflash_config.mask_token_id must be an integer")
        if mask_id < 0:
            raise ValueError("DFLASH dflash_config.mask_token_id must be non-negative")
        if mask_id >= vocab_size:
            raise ValueError("DFLASH mask_token_id is outside the target vocab size")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError("Unsupported DFlash activation")
    types = d.get("layer_types")
    if types is not None:
        for i in range(layers):
            if i >= len(types):
                raise ValueError("DFLASH config.layer_types must contain one entry per draft layer")
            if types[i] not in ("full_attention", "sliding_attention"):
                raise ValueError("Unsupported DFLASH draft layer type")
            if types[i] == "sliding_attention" and d.get("sliding_window") is None:
                raise ValueError("DFLASH sliding_attention layers require config.sliding_window")
    # The runtime target captures "before layer j + 1" for each id; an id of T - 1 has no such point (the packer
    # then hands fc fewer features than it was built for: models/dflash.py 390-399).
    if any(j + 1 >= target_layers for j in ids):
        raise ValueError("DFLASH target_hidden feature dim mismatch")
    return {"layers": layers, "ids": ids, "block_size": int(block) if block is not None else 16, "mask_id": mask_id}


# --------------------------------------------------------------------------- the loader


def sglang_params(d: dict) -> dict[str, tuple[int, ...]]:
    """DFlashDraftModel.named_parameters() with shapes (models/dflash.py 77-400): no model. prefix, qkv and gate_up
    stacked, q/k norms always built."""
    h, nh = int(d["hidden_size"]), int(d["num_attention_heads"])
    nkv, hd, inter = (
        int(d.get("num_key_value_heads", nh)),
        int(d.get("head_dim") or h // nh),
        int(d["intermediate_size"]),
    )
    K = len((d.get("dflash_config") or {})["target_layer_ids"])
    p = {"norm.weight": (h,), "fc.weight": (h, K * h), "hidden_norm.weight": (h,)}
    for i in range(int(d["num_hidden_layers"])):
        a = f"layers.{i}."
        p.update(
            {
                a + "input_layernorm.weight": (h,),
                a + "post_attention_layernorm.weight": (h,),
                a + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * hd, h),
                a + "self_attn.o_proj.weight": (h, nh * hd),
                a + "self_attn.q_norm.weight": (hd,),
                a + "self_attn.k_norm.weight": (hd,),
                a + "mlp.gate_up_proj.weight": (2 * inter, h),
                a + "mlp.down_proj.weight": (h, inter),
            }
        )
    return p


def sglang_load(d: dict, weights: dict[str, torch.Tensor]):
    """DFlashDraftModel.load_weights (models/dflash.py 439-493) over `weights`: (parameters it filled, names it
    skipped, parameters it left at their init). q/k/v shards go into qkv_proj in q, k, v order and gate/up into
    gate_up_proj (the name's `.{weight_name}.` is replaced, then tried as is, without or with `model.`); unknown names
    are ignored; a fc.weight of the wrong shape raises. Shards are assembled whole here (one rank)."""
    params = sglang_params(d)
    mapping = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))
    mapping += (("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def resolve(name):
        if name in params:
            return name
        if name.startswith("model."):
            return name[len("model.") :] if name[len("model.") :] in params else None
        return f"model.{name}" if f"model.{name}" in params else None

    shards: dict[str, dict] = {}
    filled, skipped = {}, []
    for name, w in weights.items():
        for param, weight_name, shard in mapping:
            if f".{weight_name}." not in name:
                continue
            resolved = resolve(name.replace(weight_name, param))
            if resolved is None:
                continue
            shards.setdefault(resolved, {})[shard] = w
            break
        else:
            resolved = resolve(name)
            if resolved is None:
                skipped.append(name)
                continue
            if resolved.endswith("fc.weight") and tuple(w.shape) != params[resolved]:
                raise ValueError("DFLASH fc.weight shape mismatch")
            filled[resolved] = w
    for name, parts in shards.items():
        order = ("q", "k", "v") if "qkv_proj" in name else (0, 1)
        if set(parts) == set(order):
            filled[name] = torch.cat([parts[s] for s in order], 0)
    for name, w in filled.items():
        assert tuple(w.shape) == params[name], (name, tuple(w.shape), params[name])
    return filled, skipped, sorted(set(params) - set(filled))


# --------------------------------------------------------------------------- the forward


def rms(x, w, eps, residual=None):
    """SGLang's RMSNorm.forward_native: with a residual, (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    y = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    return y if residual is None else (y, residual)


def cos_sin_cache(d: dict, n: int):
    """RotaryEmbedding / YaRNScalingRotaryEmbedding's cos_sin_cache rows 0..n-1 (base.py 149-180, yarn.py 63-146)."""
    hd = int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
    base, rs = float(d.get("rope_theta", 10000)), d.get("rope_scaling")
    pos_freqs = base ** (torch.arange(0, hd, 2, dtype=torch.float) / hd)
    if not rs:
        inv, mscale = 1.0 / pos_freqs, 1.0
    else:
        assert rs.get("rope_type", rs.get("type")) == "yarn"
        f, old = rs["factor"], rs.get("original_max_position_embeddings", d.get("max_position_embeddings", 32768))

        def cdim(r):
            return (hd * math.log(old / (r * 2 * math.pi))) / (2 * math.log(base))

        low, high = cdim(rs.get("beta_fast", 32)), cdim(rs.get("beta_slow", 1))
        if rs.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, hd - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(hd // 2, dtype=torch.float) - low) / (high - low), 0, 1)
        mask = (1 - ramp) * rs.get("extrapolation_factor", 1)
        inv = 1.0 / (f * pos_freqs) * (1 - mask) + 1.0 / pos_freqs * mask

        def ms(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        if rs.get("mscale") is not None and rs.get("mscale_all_dim") is not None:
            mscale = float(ms(f, rs["mscale"]) / ms(f, rs["mscale_all_dim"]))
        else:
            mscale = float(ms(f))
        mscale *= rs.get("attn_factor", 1)
    freqs = torch.einsum("i,j -> ij", torch.arange(n, dtype=torch.float), inv)
    return freqs.cos() * mscale, freqs.sin() * mscale


def neox(x, cos, sin):
    """apply_rotary_emb, neox style (layers/rotary_embedding/utils.py 36-62): x (T, heads, d), cos/sin (T, d/2)."""
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _dims(d):
    h, nh = int(d["hidden_size"]), int(d["num_attention_heads"])
    return h, nh, int(d.get("num_key_value_heads", nh)), int(d.get("head_dim") or h // nh)


def sglang_context_kv(d: dict, p: dict, target_hidden, positions):
    """_append_target_hidden_sequential (dflash_worker_v2.py 1091-1103, 1166-1191): ctx = hidden_norm(fc(F)) once,
    then per layer kv_proj_only (the K/V rows of qkv_proj), apply_k_norm per head, apply_k_rope. target_hidden (T,
    K·h), positions (T,) -> [(k, v) (T, nkv, d)] per layer."""
    h, nh, nkv, hd = _dims(d)
    eps = float(d.get("rms_norm_eps", 1e-6))
    ctx = rms(target_hidden @ p["fc.weight"].t(), p["hidden_norm.weight"], eps)
    cos, sin = cos_sin_cache(d, int(positions.max()) + 1)
    out = []
    for i in range(int(d["num_hidden_layers"])):
        w = p[f"layers.{i}.self_attn.qkv_proj.weight"][nh * hd : (nh + 2 * nkv) * hd]
        k, v = (ctx @ w.t()).split([nkv * hd, nkv * hd], -1)
        k = rms(k.reshape(-1, hd), p[f"layers.{i}.self_attn.k_norm.weight"], eps).view(-1, nkv, hd)
        out.append((neox(k, cos[positions], sin[positions]), v.reshape(-1, nkv, hd)))
    return out


def sglang_draft_forward(d: dict, p: dict, input_embeds, positions, ctx_kv):
    """DFlashDraftModel.forward in TARGET_VERIFY for one request (models/dflash.py 283-437): input_embeds (B, h) the
    block at `positions` (B,), ctx_kv [(k, v) (L, nkv, d)] the request's cached context; ENCODER_ONLY attention over
    [context ‖ block], fused add-norms as in DFlashDecoderLayer -> hidden (B, h) after the final norm."""
    h, nh, nkv, hd = _dims(d)
    eps = float(d.get("rms_norm_eps", 1e-6))
    cos, sin = cos_sin_cache(d, int(positions.max()) + 1)
    cos, sin = cos[positions], sin[positions]
    hidden, residual = input_embeds, None
    for i, (ck, cv) in enumerate(ctx_kv):
        a = f"layers.{i}."
        if residual is None:
            residual, x = hidden, rms(hidden, p[a + "input_layernorm.weight"], eps)
        else:
            x, residual = rms(hidden, p[a + "input_layernorm.weight"], eps, residual)
        q, k, v = (x @ p[a + "self_attn.qkv_proj.weight"].t()).split([nh * hd, nkv * hd, nkv * hd], -1)
        q = rms(q.reshape(-1, hd), p[a + "self_attn.q_norm.weight"], eps).view(-1, nh, hd)
        k = rms(k.reshape(-1, hd), p[a + "self_attn.k_norm.weight"], eps).view(-1, nkv, hd)
        q, k = neox(q, cos, sin), neox(k, cos, sin)
        keys, vals = torch.cat([ck, k], 0), torch.cat([cv, v.reshape(-1, nkv, hd)], 0)  # (L + B, nkv, d)
        o = torch.empty(q.shape[0], nh, hd, dtype=q.dtype)
        for head in range(nh):
            g = head // (nh // nkv)
            s = (q[:, head] @ keys[:, g].t()) * hd**-0.5  # (B, L + B): every block token sees everything
            o[:, head] = torch.softmax(s, -1) @ vals[:, g]
        attn = o.reshape(-1, nh * hd) @ p[a + "self_attn.o_proj.weight"].t()
        x, residual = rms(attn, p[a + "post_attention_layernorm.weight"], eps, residual)
        gate, up = (x @ p[a + "mlp.gate_up_proj.weight"].t()).chunk(2, -1)
        hidden = (F.silu(gate) * up) @ p[a + "mlp.down_proj.weight"].t()
    out, _ = rms(hidden, p["norm.weight"], eps, residual)
    return out


# --------------------------------------------------------------------------- the decode cycle


def sglang_decode(d, p, target_forward, prompt, embed, lm_head, cycles):
    """DFlashWorkerV2 greedy for one request (dflash_worker_v2.py 1392-1449 prefill, 1489-1865 decode).
    `target_forward(ids (T,)) -> (argmax (T,), features (T, K·h))` is the target's causal pass (a prefill, or a verify
    of the chain after the committed tokens, recomputed here without a cache). Prefill materialises the prompt's
    features as draft KV at positions 0..P-1 and its last argmax is the first bonus; each cycle drafts the block
    [bonus, M...] at positions L..L+B-1, takes argmax(lm_head · hidden) at block positions 1..B-1, verifies the chain,
    accepts the leading drafts equal to the target's argmax one position earlier, commits accept + 1 tokens and
    materialises the committed rows' features. Returns [(L, drafts, accept_len)] per cycle and the generated tokens."""
    dc = d.get("dflash_config") or {}
    block, mask_id = int(dc.get("block_size", d.get("block_size", 16))), int(dc["mask_token_id"])
    predict, feats = target_forward(prompt)
    L, bonus = len(prompt), int(predict[-1])
    ctx = sglang_context_kv(d, p, feats, torch.arange(L))
    committed, cycles_out = [int(t) for t in prompt] + [bonus], []
    for _ in range(cycles):
        ids = torch.full((block,), mask_id, dtype=torch.long)
        ids[0] = bonus
        positions = torch.arange(L, L + block)
        hidden = sglang_draft_forward(d, p, embed[ids], positions, ctx)
        drafts = torch.argmax(hidden[1:] @ lm_head.t(), -1)  # (B - 1,)
        candidates = torch.cat([ids[:1], drafts])
        predict, feats = target_forward(torch.cat([torch.tensor(committed[:L]), candidates]))
        predict, feats = predict[L:], feats[L:]
        accept = int((candidates[1:] == predict[:-1]).int().cumprod(0).sum())
        commit = accept + 1
        cycles_out.append((L, drafts, accept))
        committed += [int(t) for t in candidates[1 : accept + 1]] + [int(predict[accept])]
        new = sglang_context_kv(d, p, feats[:commit], positions[:commit])
        ctx = [(torch.cat([ck, nk]), torch.cat([cv, nv])) for (ck, cv), (nk, nv) in zip(ctx, new, strict=True)]
        L, bonus = L + commit, int(predict[accept])
    return cycles_out, committed[len(prompt) :]
