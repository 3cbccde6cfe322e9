"""The harvest for a DFlash drafter: the same store, aux_hidden = the outputs of its target_layer_ids (K chunks, by
its own numbering: transformers' hidden_states[j + 1]), the manifest naming them; the SGLang route refused."""

from __future__ import annotations

import pytest
import torch
from dflash_fixtures import target_features

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


def test_sglang_harvest_refused_in_one_line():
    cfg = dflash_cfg("harvest.backend=sglang")
    with pytest.raises(ValueError) as e:
        open_target(cfg.target, cfg.harvest, DFlashConfig.from_json(REPO_ROOT / DFLASH_JSON))
    assert "use harvest.backend hf" in str(e.value) and "\n" not in str(e.value)
