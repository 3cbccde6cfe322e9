"""The embedded target on the tiny random Llama: layer-id mapping, capture, generation, config checks."""

from pathlib import Path

import pytest
import torch

from eagle3ft.config import load_config
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.targets.base import Request, Sampling, Target
from eagle3ft.targets.hf import HFTarget, load_input_embedding, load_output_head, load_target

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def cfg():
    return load_config(TINY)


@pytest.fixture(scope="module")
def tiny(cfg):
    return load_target(cfg.target)


def layer_outputs_by_hook(model, ids):
    """Output of each decoder layer, captured by forward hooks: the definition of 'output of layer i'."""
    got = {}
    hooks = [
        layer.register_forward_hook(
            lambda mod, args, out, i=i: got.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return got


def test_aux_layer_ids_are_layer_outputs(cfg, tiny):
    """SGLang convention: aux id i == output of model.model.layers[i] == hidden_states[i + 1]."""
    model, tok = tiny
    ids = [3, 17, 400, 9000, 25, 77, 1024]
    aux_ids = [0, 1, 2]
    target = HFTarget(cfg.target, aux_ids, model=model, tokenizer=tok)
    (res,) = target.process([Request(ids, 0, (2,), capture=True)], Sampling(topk=4))
    hooked = layer_outputs_by_hook(model, torch.tensor([ids]))
    H = model.config.hidden_size
    for j, i in enumerate(aux_ids):
        expect = hooked[i][0].to(torch.bfloat16)
        assert torch.equal(res.features.aux_hidden[:, j * H : (j + 1) * H], expect), f"aux id {i}"
    # an off-by-one would pick a different layer's output
    assert not torch.equal(res.features.aux_hidden[:, :H], hooked[1][0].to(torch.bfloat16))


def test_capture_matches_full_logits_and_padding_is_harmless(cfg, tiny):
    model, tok = tiny
    target = HFTarget(cfg.target, [0, 1, 2], model=model, tokenizer=tok)
    short, long = [5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18]
    res = target.process(
        [Request(short, 0, (2,), True), Request(long, 0, (2,), True)], Sampling(topk=8, last_hidden=True)
    )
    for seq, r in zip((short, long), res):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([seq]), output_hidden_states=True)
        full = torch.log_softmax(out.logits[0].float(), -1)
        top = full.topk(8, -1)
        assert r.features.topk_ids.dtype == torch.int32 and r.features.topk_logprobs.dtype == torch.float32
        assert torch.equal(r.features.topk_ids.long(), top.indices)
        torch.testing.assert_close(r.features.topk_logprobs, top.values, rtol=1e-4, atol=1e-4)
        assert (r.features.topk_logprobs[:, :-1] >= r.features.topk_logprobs[:, 1:]).all()
        torch.testing.assert_close(r.features.last_hidden.float(), out.hidden_states[-1][0].to(torch.bfloat16).float())
        assert r.features.aux_hidden.shape == (len(seq), 3 * model.config.hidden_size)


def test_batched_left_padded_generation_equals_one_by_one(cfg, tiny):
    model, tok = tiny
    target = HFTarget(cfg.target, [0, 1, 2], model=model, tokenizer=tok)
    assert isinstance(target, Target)
    prompts = [[1, 4093, 198, 31041], [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173]]
    greedy = Sampling(topk=4)
    batched = target.process([Request(p, 6, (2,), capture=False) for p in prompts], greedy)
    for p, b in zip(prompts, batched):
        (single,) = target.process([Request(p, 6, (2,), capture=False)], greedy)
        assert b.completion_ids == single.completion_ids and len(b.completion_ids) == 6 and b.features is None
        seq = list(p)
        for _ in range(6):  # plain argmax decoding without a cache
            with torch.no_grad():
                seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(p) :] == b.completion_ids


def test_tiny_target_is_seeded_and_weights_load(cfg, tiny):
    model, _ = tiny
    again, _ = load_target(cfg.target)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    emb, head = load_input_embedding(cfg.target), load_output_head(cfg.target)
    assert torch.equal(emb, model.model.embed_tokens.weight) and torch.equal(head, model.lm_head.weight)


def test_drafter_config_disagreements_are_named(cfg):
    spec = DrafterConfig.from_json(REPO / "configs" / "drafters" / "tiny.json")
    assert spec.check_target(64, 49152, 4) == [0, 1, 2]
    with pytest.raises(ValueError, match="hidden_size 64.*96|64 != target hidden_size 96"):
        spec.check_target(96, 49152, 4)
    with pytest.raises(ValueError, match="vocab_size 49152 != target vocab_size 32000"):
        spec.check_target(64, 32000, 4)
    with pytest.raises(ValueError, match=r"\[2\] outside"):
        spec.check_target(64, 49152, 2)
    smol = DrafterConfig.from_json(REPO / "configs" / "drafters" / "smollm2-135m.json")
    assert smol.aux_layer_ids == [1, 14, 26] and smol.draft_vocab_size == 8192


def test_embedding_and_head_read_alone_from_a_safetensors_folder(tiny, tmp_path):
    from dataclasses import replace

    from safetensors import safe_open

    model, tok = tiny
    model.save_pretrained(tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" in f.keys()
    hf = replace(load_config(TINY).target, kind="hf", path=str(tmp_path / "hf"))
    assert torch.equal(load_input_embedding(hf), model.model.embed_tokens.weight)
    assert torch.equal(load_output_head(hf), model.lm_head.weight)
    loaded, _ = load_target(hf)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
