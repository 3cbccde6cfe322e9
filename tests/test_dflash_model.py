"""The DFlash drafter (eagle3ft/drafter/dflash_*.py) against SGLang 0.5.17's DFlashDraftModel as tests/sglang_dflash.py
reimplements it: the config it parses and refuses, the weights its loader fills, the draft forward and tokens; the
batched training form against one SGLang cycle per anchor; and a context leak caught."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from sglang_dflash import cos_sin_cache, sglang_context_kv, sglang_draft_forward, sglang_load, sglang_parse
from train_fixtures import REPO

from eagle3ft.drafter import dflash_model
from eagle3ft.drafter.dflash_config import DFlashConfig, default_target_layer_ids
from eagle3ft.drafter.dflash_export import check_keys, export_keys, load, save
from eagle3ft.drafter.dflash_model import DFlashDrafter, DraftContext, block_mask, noise_ids, rope_cos_sin

V = 300  # a small target vocabulary for the forward tests
TINY = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "hidden_act": "silu",
    "num_target_layers": 4,
    "block_size": 4,
    "layer_types": ["full_attention", "full_attention"],
    "dflash_config": {"target_layer_ids": [0, 1, 2], "mask_token_id": V - 1},
}
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 4, "beta_slow": 1}


def tiny(**over) -> dict:
    return json.loads(json.dumps({**TINY, **over}))


def random_drafter(raw: dict, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    m = DFlashDrafter(DFlashConfig.from_dict(raw))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3)
    return m.double()


def sglang_weights(m: DFlashDrafter, raw: dict, prefix: str = "") -> dict:
    filled, skipped, unfilled = sglang_load(raw, {prefix + k: v for k, v in m.state_dict().items()})
    assert skipped == [] and unfilled == []
    return filled


def target_tensors(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, 64, generator=g, dtype=torch.float64), torch.randn(V, 64, generator=g, dtype=torch.float64)


# --------------------------------------------------------------------------- against SGLang's forward


@pytest.mark.parametrize("rope", [None, YARN])
@pytest.mark.parametrize("prefix", ["", "model."])
def test_one_cycle_gives_sglangs_hidden_states_and_draft_tokens(rope, prefix):
    raw = tiny(rope_scaling=rope) if rope else tiny()
    m = random_drafter(raw)
    p = sglang_weights(m, raw, prefix)
    embed, head = target_tensors()
    L = 11
    feats = torch.randn(L, 3 * 64, dtype=torch.float64)
    bonus = 17
    ids = torch.tensor([bonus] + [V - 1] * 3)
    ref = sglang_draft_forward(
        raw, p, embed[ids], torch.arange(L, L + 4), sglang_context_kv(raw, p, feats, torch.arange(L))
    )
    with torch.no_grad():
        ours = m(feats[None], embed[ids][None], torch.tensor([[L]]))[0]
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)
    ctx = DraftContext(m)
    ctx.append(feats[None, :7])  # a prompt, then a commit
    ctx.append(feats[None, 7:])
    drafts = ctx.draft(torch.tensor([bonus]), embed, head)[0]
    assert ctx.length == L and torch.equal(drafts, torch.argmax(ref[1:] @ head.t(), -1))


def test_many_anchors_in_one_forward_equal_one_sglang_cycle_per_anchor():
    raw = tiny()
    m = random_drafter(raw, seed=3)
    p = sglang_weights(m, raw)
    embed, _ = target_tensors()
    S = 20
    tokens = torch.randint(0, V - 1, (2, S))
    feats = torch.randn(2, S, 3 * 64, dtype=torch.float64)
    anchors = torch.tensor([[1, 2, 9, 17], [4, 5, 6, 16]])  # overlapping blocks, and one reaching past S
    ids = noise_ids(tokens, anchors, 4, V - 1)
    with torch.no_grad():
        out = m(feats, embed[ids], anchors).view(2, 4, 4, 64)
    for b in range(2):
        for n, a in enumerate(anchors[b].tolist()):
            ctx = sglang_context_kv(raw, p, feats[b, :a], torch.arange(a))
            ref = sglang_draft_forward(raw, p, embed[ids[b, 4 * n : 4 * n + 4]], torch.arange(a, a + 4), ctx)
            torch.testing.assert_close(out[b, n], ref, rtol=1e-9, atol=1e-9)


def leaks(m: DFlashDrafter, seed: int = 0) -> bool:
    """Does a block's output depend on what it must not see: the target features at or after its anchor, or another
    block's tokens? Features of positions >= a and the other blocks' inputs are replaced; block n must not move."""
    g = torch.Generator().manual_seed(seed)
    S, anchors = 16, torch.tensor([[3, 4, 10]])
    feats = torch.randn(1, S, 3 * 64, generator=g, dtype=torch.float64)
    noise = torch.randn(1, 12, 64, generator=g, dtype=torch.float64)
    with torch.no_grad():
        base = m(feats, noise, anchors).view(3, 4, 64)
        for n, a in enumerate(anchors[0].tolist()):
            f2, z2 = feats.clone(), noise.clone()
            f2[:, a:] = torch.randn(1, S - a, 3 * 64, generator=g, dtype=torch.float64)
            others = [i for i in range(12) if i // 4 != n]
            z2[:, others] = torch.randn(1, len(others), 64, generator=g, dtype=torch.float64)
            if not torch.allclose(m(f2, z2, anchors).view(3, 4, 64)[n], base[n], rtol=0, atol=1e-12):
                return True
            f3 = feats.clone()
            f3[:, a - 1] += 1.0  # the last feature it may see must matter
            assert not torch.allclose(m(f3, noise, anchors).view(3, 4, 64)[n], base[n])
    return False


def test_a_block_sees_no_feature_at_or_after_its_anchor_and_no_other_block():
    assert not leaks(random_drafter(tiny()))


@pytest.mark.parametrize("leak", ["anchor's own feature", "every feature", "other blocks"])
def test_the_leak_check_catches_a_leaky_mask(leak, monkeypatch):
    right = block_mask

    def leaky(anchors, context_len, block_size):
        mask = right(anchors, context_len, block_size)
        S = context_len
        if leak == "anchor's own feature":
            return right(anchors + 1, context_len, block_size)
        if leak == "every feature":
            mask[..., :S] = True
        else:
            mask[..., S:] = True
        return mask

    monkeypatch.setattr(dflash_model, "block_mask", leaky)
    assert leaks(random_drafter(tiny()))


# --------------------------------------------------------------------------- config, export, refusals


def test_config_round_trips_and_the_shipped_configs_load():
    raw = tiny(rope_scaling=YARN, auto_map={"AutoModel": "x"}, tie_word_embeddings=True)
    raw["dflash_config"]["future_key"] = 1
    cfg = DFlashConfig.from_dict(raw)
    assert DFlashConfig.from_dict(cfg.to_hf_dict()) == cfg
    out = cfg.to_hf_dict()
    assert out["auto_map"] == {"AutoModel": "x"} and out["tie_word_embeddings"] and cfg.num_features == 3
    assert out["dflash_config"]["future_key"] == 1
    # a published drafter's form: block size top-level only, rope_scaling null, a sliding window that is off
    pub = tiny(block_size=16, rope_scaling=None, use_sliding_window=False, sliding_window=None, layer_types=None)
    assert DFlashConfig.from_dict(pub).block_size == 16
    smol = DFlashConfig.from_json(REPO / "configs/drafters/smollm2-135m-dflash.json")
    assert (smol.hidden_size, smol.num_target_layers, smol.block_size) == (576, 30, 16)
    assert smol.target_layer_ids == default_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    smol.check_target(576, 49152, 30, context_length=8192)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        smol.check_target(576, 49152, 30, context_length=16384)
    kimi = DFlashConfig.from_json(REPO / "configs/drafters/kimi-k25-dflash.json")
    assert kimi.target_layer_ids == default_target_layer_ids(61, 6) == [1, 12, 24, 35, 47, 58]
    kimi.check_target(7168, 163840, 61, context_length=262144)
    for c in (smol, kimi):
        sglang_parse(c.to_hf_dict(), c.num_target_layers, c.vocab_size or 163840)


REFUSED = {  # what SGLang 0.5.17 refuses, and DFlashConfig with it
    "gelu": {"hidden_act": "gelu"},
    "empty ids": {"dflash_config": {"target_layer_ids": [], "mask_token_id": 5}},
    "id past the target": {"dflash_config": {"target_layer_ids": [0, 4], "mask_token_id": 5}},
    "last layer's output": {"dflash_config": {"target_layer_ids": [0, 3], "mask_token_id": 5}},
    "negative mask": {"dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": -1}},
    "mask past the vocab": {"dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": V}},
    "bool mask": {"dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": True}},
    "too few layer types": {"layer_types": ["full_attention"]},
    "unknown layer type": {"layer_types": ["full_attention", "chunked"]},
    "block 0": {"block_size": 0},
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_sglang_refuses_is_refused(case):
    raw = tiny(**REFUSED[case])
    with pytest.raises(ValueError):
        sglang_parse(raw, 4, V)
    with pytest.raises(ValueError):
        DFlashConfig.from_dict(raw).check_target(64, V, 4)
    sglang_parse(tiny(), 4, V)
    DFlashConfig.from_dict(tiny()).check_target(64, V, 4)


@pytest.mark.parametrize(
    "over",
    [
        {"dflash_config": {"target_layer_ids": [2, 1], "mask_token_id": 5}},
        {"dflash_config": {"target_layer_ids": [1, 1], "mask_token_id": 5}},
        {"layer_types": ["sliding_attention"] * 2, "sliding_window": 8},
        {"layer_types": None, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        {"attention_bias": True},
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    ],
)
def test_what_the_model_cannot_build_or_the_harvest_cannot_order_is_refused(over):
    with pytest.raises(ValueError):
        DFlashConfig.from_dict(tiny(**over))


def test_save_load_round_trip_fills_every_sglang_parameter(tmp_path):
    m = random_drafter(tiny()).float()
    save(m, tmp_path / "d")
    weights = load_file(tmp_path / "d" / "model.safetensors")
    assert sorted(weights) == sorted(export_keys(m.config))
    assert not any("embed" in k or "lm_head" in k for k in weights)
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["layer_types"] == ["full_attention"] * 2
    assert raw["dflash_config"]["target_layer_ids"] == [0, 1, 2] and raw["dflash_config"]["mask_token_id"] == V - 1
    filled, skipped, unfilled = sglang_load(raw, weights)
    assert skipped == [] and unfilled == []
    n = load(tmp_path / "d")
    for k, v in m.state_dict().items():
        assert torch.equal(n.state_dict()[k], v)
    with pytest.raises(ValueError, match="left at their init value.*q_norm"):
        check_keys([k for k in weights if "layers.1.self_attn.q_norm" not in k], m.config, "t")
    with pytest.raises(ValueError, match="skipped silently.*embed_tokens"):
        check_keys([*weights, "embed_tokens.weight"], m.config, "t")
    save_file({**weights, "embed_tokens.weight": torch.zeros(2, 64)}, tmp_path / "d" / "model.safetensors")
    with pytest.raises(ValueError, match="skipped silently"):
        load(tmp_path / "d")
    assert torch.equal(load(tmp_path / "d", allow_extra=True).fc.weight, m.fc.weight)


@pytest.mark.parametrize("name", ["smollm2-135m-dflash", "kimi-k25-dflash"])
def test_rope_is_sglangs_cache_bit_for_bit(name):
    raw = json.loads((REPO / f"configs/drafters/{name}.json").read_text())
    cos, sin = cos_sin_cache(raw, 9000)
    ours_cos, ours_sin = rope_cos_sin(DFlashConfig.from_dict(raw), torch.arange(9000))
    assert torch.equal(ours_cos, cos) and torch.equal(ours_sin, sin)
