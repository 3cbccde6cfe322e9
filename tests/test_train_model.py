"""The drafter against transformers' Llama pieces with copied weights, its cache, and its keys."""

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.model import DraftCache, Eagle3Drafter, export_keys

H, NH, NKV, HD, I, V, VD = 32, 4, 2, 8, 48, 50, 20


def make(rope_scaling=None, seed=0, layers=1) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=H,
        num_attention_heads=NH,
        num_key_value_heads=NKV,
        head_dim=HD,
        intermediate_size=I,
        vocab_size=V,
        draft_vocab_size=VD,
        rms_norm_eps=1e-5,
        rope_theta=500.0,
        rope_scaling=rope_scaling,
        max_position_embeddings=64,
        num_hidden_layers=layers,
    )
    m = Eagle3Drafter(cfg)
    with torch.no_grad():
        m.embed_tokens.weight.normal_()
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        m.d2t.copy_(torch.arange(VD) * 2 - torch.arange(VD))  # draft id i -> target id 2i
        m.t2d[::2][:VD] = True
    return m


def hf_config(m: Eagle3Drafter) -> LlamaConfig:
    c = m.config
    rope = {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})}
    return LlamaConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=rope,
        vocab_size=c.vocab_size,
    )


def test_checkpoint_keys_are_sglangs():
    m = make()
    keys = sorted(k for k in m.state_dict() if k != "embed_tokens.weight")
    assert keys == sorted(export_keys())
    assert set(keys) == {
        "fc.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight",
        "midlayer.self_attn.o_proj.weight",
        "midlayer.post_attention_layernorm.weight",
        "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    }
    sd = m.state_dict()
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (NH * HD, 2 * H)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (NKV * HD, 2 * H)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (H, NH * HD)
    assert sd["fc.weight"].shape == (H, 3 * H)
    assert sd["lm_head.weight"].shape == (VD, H)
    assert not m.embed_tokens.weight.requires_grad


def test_norms_and_mlp_match_transformers():
    m = make()
    hf = hf_config(m)
    x = torch.randn(2, 5, H)
    for ours in (m.norm, m.midlayer.input_layernorm, m.midlayer.hidden_norm, m.midlayer.post_attention_layernorm):
        ref = LlamaRMSNorm(H, eps=1e-5)
        ref.load_state_dict(ours.state_dict())
        torch.testing.assert_close(ours(x), ref(x))
    ref = LlamaMLP(hf)
    ref.load_state_dict(m.midlayer.mlp.state_dict())
    torch.testing.assert_close(m.midlayer.mlp(x), ref(x))


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1},
    ],
)
def test_rope_matches_transformers(rope_scaling):
    m = make(rope_scaling)
    ref = LlamaRotaryEmbedding(hf_config(m))
    pos = torch.arange(40)[None]
    cos, sin = m.rope(pos, torch.float32)
    rcos, rsin = ref(torch.zeros(1, dtype=torch.float32), pos)
    torch.testing.assert_close(cos, rcos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, rsin, rtol=1e-5, atol=1e-5)


def test_unknown_rope_type_is_refused():
    with pytest.raises(ValueError, match="rope type 'longrope' is not supported"):
        Eagle3Drafter(
            DrafterConfig.from_dict(
                {
                    "hidden_size": 8,
                    "num_attention_heads": 2,
                    "intermediate_size": 16,
                    "vocab_size": 10,
                    "rope_scaling": {"rope_type": "longrope", "factor": 2.0},
                }
            )
        )


def reference_layer(m: Eagle3Drafter, ids, hidden, pos):
    """SGLang's Eagle3 decoder layer written out with transformers' Llama pieces and plain attention."""
    hf = hf_config(m)
    norms = {}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        norms[name] = LlamaRMSNorm(H, eps=1e-5)
        norms[name].load_state_dict(getattr(m.midlayer, name).state_dict())
    final = LlamaRMSNorm(H, eps=1e-5)
    final.load_state_dict(m.norm.state_dict())
    mlp = LlamaMLP(hf)
    mlp.load_state_dict(m.midlayer.mlp.state_dict())
    at = m.midlayer.self_attn
    B, T = ids.shape
    x = torch.cat([norms["input_layernorm"](m.embed_tokens(ids)), norms["hidden_norm"](hidden)], -1)
    q = (x @ at.q_proj.weight.t()).view(B, T, NH, HD).transpose(1, 2)
    k = (x @ at.k_proj.weight.t()).view(B, T, NKV, HD).transpose(1, 2)
    v = (x @ at.v_proj.weight.t()).view(B, T, NKV, HD).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(hf)(x, pos)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = repeat_kv(k, NH // NKV), repeat_kv(v, NH // NKV)
    s = q @ k.transpose(-1, -2) / math.sqrt(HD)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, NH * HD)
    h = hidden + o @ at.o_proj.weight.t()
    out = h + mlp(norms["post_attention_layernorm"](h))
    return out, final(out) @ m.lm_head.weight.t()


def test_step_matches_reference_layer():
    m = make(seed=1)
    ids, aux = torch.randint(0, V, (2, 7)), torch.randn(2, 7, 3 * H)
    pos = torch.arange(7).expand(2, 7)
    hidden = m.fuse(aux)
    torch.testing.assert_close(hidden, aux @ m.fc.weight.t())
    out, logits = m.step(ids, hidden, pos, DraftCache())
    ref_out, ref_logits = reference_layer(m, ids, hidden, pos)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layers", [1, 3])
def test_cache_incremental_crop_and_tree_mask(layers):
    """A deeper drafter's layers keep their caches over the same rows (DraftCache.above)."""
    m = make(seed=2, layers=layers)
    ids, hidden = torch.randint(0, V, (1, 8)), torch.randn(1, 8, H)
    pos = torch.arange(8)[None]
    full, _ = m.step(ids, hidden, pos, DraftCache())
    cache = DraftCache()
    a, _ = m.step(ids[:, :5], hidden[:, :5], pos[:, :5], cache)
    b, _ = m.step(ids[:, 5:], hidden[:, 5:], pos[:, 5:], cache)
    assert [c.length for c in (cache, *cache.above)] == [8] * layers
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=1e-5, atol=1e-5)
    cache.crop(5)  # roll back the last three, then redo them one token at a time
    assert [c.length for c in (cache, *cache.above)] == [5] * layers
    for t in range(5, 8):
        o, _ = m.step(ids[:, t : t + 1], hidden[:, t : t + 1], pos[:, t : t + 1], cache)
        torch.testing.assert_close(o, full[:, t : t + 1], rtol=1e-5, atol=1e-5)
    # a tree: two siblings at position 5 that each see the 5-token prefix and themselves only
    cache.crop(5)
    mask = torch.zeros(1, 1, 2, 7, dtype=torch.bool)
    mask[..., :5] = True
    mask[0, 0, 0, 5] = mask[0, 0, 1, 6] = True
    sib_ids = torch.stack([ids[:, 5], torch.full_like(ids[:, 5], 3)], 1)
    o, _ = m.step(sib_ids, hidden[:, [5, 5]], torch.tensor([[5, 5]]), cache, attn_mask=mask)
    torch.testing.assert_close(o[:, :1], full[:, 5:6], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        cache.crop(99)


def test_draft_to_target_and_config_round_trip(tmp_path):
    m = make()
    assert m.draft_to_target(torch.tensor([0, 3, 7])).tolist() == [0, 6, 14]
    d = m.config.to_hf_dict()
    assert (
        d["architectures"] == ["LlamaForCausalLMEagle3"]
        and d["num_hidden_layers"] == 1
        and d["tie_word_embeddings"] is False
    )
    assert DrafterConfig.from_dict(d).to_hf_dict() == d


# --------------------------------------------------------------------------- EAGLE-3.1 options


def make31(fc_norm: bool, norm_output: bool, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=H,
        num_attention_heads=NH,
        num_key_value_heads=NKV,
        head_dim=HD,
        intermediate_size=I,
        vocab_size=V,
        draft_vocab_size=VD,
        target_hidden_size=24,
        rms_norm_eps=1e-5,
        fc_norm=fc_norm,
        norm_output=norm_output,
    )
    m = Eagle3Drafter(cfg).double()
    with torch.no_grad():
        m.embed_tokens.weight.normal_()
        for p in m.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return m


def test_eagle31_flags_round_trip_and_key_names():
    m = make31(True, True)
    d = m.config.to_hf_dict()
    assert d["fc_norm"] is True and d["norm_output"] is True
    assert DrafterConfig.from_dict(d).to_hf_dict() == d
    keys = sorted(k for k in m.state_dict() if k != "embed_tokens.weight")
    assert keys == sorted(export_keys(fc_norm=True))
    assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= set(keys)
    assert m.state_dict()["fc_norm.1.weight"].shape == (24,)  # one per aux layer, target hidden wide
    legacy = {k: v for k, v in d.items() if k != "fc_norm"} | {"use_aux_norm": True}  # SGLang's legacy name
    assert DrafterConfig.from_dict(legacy).fc_norm
    off = make31(False, False).config.to_hf_dict()
    assert "fc_norm" not in off and "norm_output" not in off  # EAGLE-3 config.json unchanged
    for bad in ({"bias": True}, {"eagle_config": {"norm_before_fc": True}}):
        with pytest.raises(ValueError, match="bias or eagle_config.norm_before_fc"):
            DrafterConfig.from_dict({**off, **bad}).check_supported()


def test_eagle31_forward_pieces():
    """fc_norm normalises each aux chunk before fc; norm_output feeds norm(out) to the next step, logits unchanged."""
    m = make31(True, True)
    aux = torch.randn(1, 5, 72, dtype=torch.float64)
    chunks = aux.chunk(3, dim=-1)
    want = m.fc(torch.cat([n(c) for n, c in zip(m.fc_norm, chunks)], dim=-1))
    torch.testing.assert_close(m.fuse(aux), want)
    assert not torch.allclose(m.fuse(aux), m.fc(aux))
    ids, pos = torch.randint(0, V, (1, 5)), torch.arange(5)[None]
    h, lg = m.step(ids, m.fuse(aux), pos, DraftCache())
    plain = make31(True, False)
    plain.load_state_dict(m.state_dict())
    h0, lg0 = plain.step(ids, plain.fuse(aux), pos, DraftCache())
    torch.testing.assert_close(lg, lg0)
    torch.testing.assert_close(h, m.norm(h0))


def test_flags_off_is_todays_drafter():
    """With both flags off, the drafter's step, decode and TTT loss equal the pre-3.1 code's (golden from that
    commit)."""
    import json
    from pathlib import Path

    from eagle3ft.train.ttt import ttt_forward

    g = json.loads((Path(__file__).parent / "golden/drafter_eagle3_head.json").read_text())
    cfg = DrafterConfig(
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=24,
        vocab_size=40,
        draft_vocab_size=12,
        rms_norm_eps=1e-5,
    )
    m = Eagle3Drafter(cfg).double()
    m.load_state_dict({k: torch.tensor(v, dtype=m.state_dict()[k].dtype) for k, v in g["state"].items()})
    assert m.fc_norm is None and set(g["state"]) == set(m.state_dict())
    ids, aux = torch.tensor(g["ids"]), torch.tensor(g["aux"], dtype=torch.float64)
    cache = DraftCache()
    h, lg = m.step(ids[:, 1:], m.fuse(aux[:, :-1]), torch.arange(5)[None], cache)
    h2, lg2 = m.step(ids[:, :1], h[:, -1:], torch.tensor([[5]]), cache)
    for ours, key in ((h, "hidden"), (lg, "logits"), (h2, "hidden2"), (lg2, "logits2")):
        torch.testing.assert_close(ours, torch.tensor(g[key], dtype=torch.float64), rtol=1e-12, atol=1e-12)
    batch = {
        "input_ids": ids,
        "loss_mask": torch.ones(1, 6, dtype=torch.long),
        "aux_hidden": aux,
        "topk_ids": torch.tensor(g["topk_ids"]),
        "topk_logprobs": torch.tensor(g["topk_logprobs"]),
    }
    out = ttt_forward(m, batch, steps=3)
    # the TTT loss is float32 by design (train/losses.py), so it holds to float32's precision: an AMD EPYC (AVX2)
    # sums it 7e-8 apart from the Intel machine that wrote the golden file
    assert out.loss.item() == pytest.approx(g["ttt_loss"], rel=1e-6)
    assert out.step_loss.tolist() == pytest.approx(g["ttt_step_loss"], rel=1e-6)
