"""The flagship's architecture on every commit: a seeded tiny DeepSeek-V3 (MLA + MoE, configs/tiny-deepseek.yaml)
through the embedded capture and the harvest's entry point. SGLang 0.5.17 takes a DeepSeek-V3's aux id i as the state
entering layer i (transformers hidden_states[i]) unless the first id is 1, then as the output of layer i
(hidden_states[i + 1]), as it does for every id of a Llama."""

import json

import pytest
import torch

from eagle3ft.config import REPO_ROOT, load_config
from eagle3ft.data.harvest import main
from eagle3ft.data.store import FeatureStore
from eagle3ft.targets.base import Request, Sampling
from eagle3ft.targets.hf import HFTarget, load_target
from eagle3ft.targets.sglang import target_identity

CONFIG = REPO_ROOT / "configs" / "tiny-deepseek.yaml"
AUX = [0, 1, 2]


@pytest.fixture(scope="module")
def deepseek():
    cfg = load_config(CONFIG)
    model, tokenizer = load_target(cfg.target)
    return cfg, model, tokenizer


def plain_hidden_states(model, ids: list[int]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states


def test_the_target_is_a_seeded_deepseek_v3_with_mla_and_moe(deepseek):
    cfg, model, _ = deepseek
    c = model.config
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and c.vocab_size == 49152
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim, c.first_k_dense_replace) == (32, 16, 8, 1)
    mlps = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert mlps == ["DeepseekV3MLP"] + ["DeepseekV3MoE"] * 3
    assert model.model.layers[1].mlp.shared_experts is not None
    assert target_identity(cfg.target, cfg.harvest.sglang) == (64, 49152, 4)  # what the SGLang client checks
    again, _ = load_target(cfg.target)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_captured_aux_rows_are_the_hidden_states_of_a_plain_forward(deepseek):
    cfg, model, tokenizer = deepseek
    ids = [3, 17, 400, 9000, 25, 77, 1024, 5]
    target = HFTarget(cfg.target, AUX, model=model, tokenizer=tokenizer)
    (res,) = target.process([Request(ids, 0, (2,), capture=True)], Sampling(topk=4))
    hs = plain_hidden_states(model, ids)
    H = model.config.hidden_size
    for k, i in enumerate(AUX):  # [0, 1, 2]: the embeddings and the outputs of layers 0 and 1
        assert torch.equal(res.features.aux_hidden[:, k * H : (k + 1) * H], hs[i][0].to(torch.bfloat16)), i
    (res,) = HFTarget(cfg.target, [1, 2], model=model, tokenizer=tokenizer).process(
        [Request(ids, 0, (2,), capture=True)], Sampling(topk=4)
    )
    for k, i in enumerate([1, 2]):  # a first id of 1: the outputs of layers 1 and 2
        assert torch.equal(res.features.aux_hidden[:, k * H : (k + 1) * H], hs[i + 1][0].to(torch.bfloat16)), i
    with pytest.raises(ValueError, match="last layer"):  # [2, 3, 4]: the last layer's output
        HFTarget(cfg.target, [1, 2, 3], model=model, tokenizer=tokenizer)


def test_a_harvest_through_the_entry_point_stores_those_rows(deepseek, tmp_path, capsys):
    cfg, model, _ = deepseek
    main(["--config", str(CONFIG), "--run-dir", str(tmp_path)])
    summary = json.loads(capsys.readouterr().out)
    assert summary["target"] == {
        "name": "tiny-deepseek-v3",
        "hidden_size": 64,
        "vocab_size": 49152,
        "num_layers": 4,
        "aux_layer_ids": AUX,
    }
    assert summary["samples"] == {"train": 6, "heldout": 2} and summary["argmax_check"]["mismatched"] == 0
    H = model.config.hidden_size
    store = FeatureStore(tmp_path / "features")
    for split in ("train", "heldout"):
        for item in store.dataset(split):
            assert item["loss_mask"].sum() > 0
            hs = plain_hidden_states(model, item["input_ids"].tolist())
            for k, i in enumerate(AUX):  # batched and padded in the harvest, alone here
                torch.testing.assert_close(
                    item["aux_hidden"][:, k * H : (k + 1) * H].float(),
                    hs[i][0].to(torch.bfloat16).float(),
                    atol=0.02,
                    rtol=0.02,
                )
