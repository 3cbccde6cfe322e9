"""The harvest for a DFlash drafter: the same store, aux_hidden = the outputs of its target_layer_ids (K chunks, by
its own numbering: transformers' hidden_states[j + 1]), the manifest naming them; through SGLang by EAGLE-3-numbered
capture ids that name the same layers, refused where none do."""

from __future__ import annotations

import json

import pytest
import torch
from dflash_fixtures import target_features
from sglang_double import DoubleEngine, SGLangDouble

from eagle3ft.config import REPO_ROOT, load_config
from eagle3ft.data.harvest import run_harvest
from eagle3ft.data.store import FeatureStore
from eagle3ft.drafter.dflash_config import DFlashConfig
from eagle3ft.run_dir import RunDir
from eagle3ft.targets import open_target
from eagle3ft.targets.hf import load_target

DFLASH_JSON = "configs/drafters/tiny-dflash.json"


def dflash_cfg(*overrides):
    return load_config(
        REPO_ROOT / "configs" / "tiny.yaml",
        [
            f"drafter.config={DFLASH_JSON}",
            "harvest.sources=[{kind: sharegpt, limit: 3}, {kind: mtbench, limit: 1, split: heldout}]",
            "harvest.max_new_tokens=8",
            *overrides,
        ],
    )


def test_dflash_harvest_captures_its_layers_by_its_numbering(tmp_path):
    cfg = dflash_cfg()
    summary = run_harvest(cfg, tmp_path)
    assert summary["draft_vocab"] is None and not RunDir(tmp_path).vocab.exists()
    store = FeatureStore(RunDir(tmp_path).features)
    ident = store.target
    assert ident["aux_layer_ids"] == [0, 1, 2]
    assert ident["capture"] == {"kind": "dflash", "hidden_states": [1, 2, 3]}
    model, _ = load_target(cfg.target)
    sample = store.dataset("train")[0]
    ids = sample["input_ids"].long()[None]
    want, _ = target_features(model.float().eval(), ids, [0, 1, 2])
    assert sample["aux_hidden"].shape == (ids.shape[1], 3 * 64)
    torch.testing.assert_close(sample["aux_hidden"].float(), want[0].float(), atol=2e-2, rtol=1e-2)  # bf16 store


def test_dflash_numbering_on_deepseek_is_outputs_not_eagle3s():
    cfg = load_config(REPO_ROOT / "configs" / "tiny-deepseek.yaml", [f"drafter.config={DFLASH_JSON}"])
    spec = DFlashConfig.from_json(REPO_ROOT / DFLASH_JSON)
    target = open_target(cfg.target, cfg.harvest, spec)
    assert target.capture_points == (1, 2, 3)  # EAGLE-3's hook on DeepseekV2 would take [0, 1, 2] as given


def test_eagle3_capture_ids_name_the_dflash_layers():
    """SGLang's EAGLE3 capture, asked for these ids, takes the outputs of target_layer_ids (capture_points is its rule)."""
    smol = DFlashConfig.from_json(REPO_ROOT / "configs/drafters/smollm2-135m-dflash.json")
    kimi = DFlashConfig.from_json(REPO_ROOT / "configs/drafters/kimi-k25-dflash.json")
    tiny = DFlashConfig.from_json(REPO_ROOT / DFLASH_JSON)
    assert smol.eagle3_capture_ids(["LlamaForCausalLM"]) == [1, 8, 14, 20, 27]  # both Llama hooks add 1
    assert kimi.eagle3_capture_ids(["KimiK25ForConditionalGeneration"]) == [1, 12, 24, 35, 47, 58]  # [1, ...]: +1
    shifted = DFlashConfig.from_dict(
        {**tiny.to_hf_dict(), "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": 16}}
    )
    assert shifted.eagle3_capture_ids(["DeepseekV3ForCausalLM"]) == [1, 2]  # [1, ...]: +1 as the DFlash hook
    later = DFlashConfig.from_dict(
        {**tiny.to_hf_dict(), "dflash_config": {"target_layer_ids": [2], "mask_token_id": 16}}
    )
    assert later.eagle3_capture_ids(["DeepseekV3ForCausalLM"]) == [3]  # taken as given: the input of layer 3
    assert kimi.eagle3_capture_ids_on_any_target() == [1, 12, 24, 35, 47, 58]
    assert tiny.eagle3_capture_ids_on_any_target() is None  # [0, 1, 2] carries over on a Llama only
    assert tiny.eagle3_capture_ids(["DeepseekV3ForCausalLM"]) is None  # [0, ...] is the embeddings, [1, ...] shifts
    assert tiny.eagle3_capture_ids(["LlamaForCausalLM"]) == [0, 1, 2]
    capture = json.loads((REPO_ROOT / "configs/drafters/smollm2-135m-dflash-capture/config.json").read_text())
    assert capture["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == smol.eagle3_capture_ids(None)


def test_sglang_harvest_refused_in_one_line_where_no_ids_name_the_layers():
    cfg = load_config(
        REPO_ROOT / "configs" / "tiny-deepseek.yaml", [f"drafter.config={DFLASH_JSON}", "harvest.backend=sglang"]
    )
    with pytest.raises(ValueError) as e:
        open_target(cfg.target, cfg.harvest, DFlashConfig.from_json(REPO_ROOT / DFLASH_JSON))
    assert "use harvest.backend hf" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_dflash_harvest_through_sglang_equals_embedded(tmp_path):
    """SGLang 0.5.23's aux capture (the double) asked for the EAGLE-3-numbered ids gives the same store as the
    embedded harvest: the outputs of target_layer_ids, K chunks."""
    hf_run, sgl_run = tmp_path / "hf", tmp_path / "sglang"
    run_harvest(dflash_cfg(), hf_run)
    cfg = load_config(REPO_ROOT / "configs/tiny.yaml")
    model, tok = load_target(cfg.target)
    ids = DFlashConfig.from_json(REPO_ROOT / DFLASH_JSON).eagle3_capture_ids(None)
    with SGLangDouble(DoubleEngine(model, tok, aux_layer_ids=ids), version="0.5.23") as d:
        run_harvest(
            dflash_cfg("harvest.backend=sglang", f"harvest.sglang.urls=[{d.url}]", "harvest.sglang.capture=two_pass"),
            sgl_run,
        )
    a, b = FeatureStore(RunDir(hf_run).features), FeatureStore(RunDir(sgl_run).features)
    assert b.target["capture"] == {"kind": "dflash", "hidden_states": [1, 2, 3]}
    for split in ("train", "heldout"):
        da, db = a.dataset(split), b.dataset(split)
        assert len(da) == len(db) > 0
        for x, y in zip(da, db):
            assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
            assert y["aux_hidden"].shape == x["aux_hidden"].shape == (x["input_ids"].shape[0], 3 * 64)
            torch.testing.assert_close(y["aux_hidden"].float(), x["aux_hidden"].float(), atol=1e-2, rtol=1e-2)
