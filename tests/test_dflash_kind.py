"""The drafter kind by config: drafter.config's architectures pick DFlash or EAGLE-3; a mix is a one-line error."""

from __future__ import annotations

import dataclasses

import pytest
from dflash_fixtures import random_dflash, tiny_dflash_config
from train_fixtures import REPO

from eagle3ft.config import load_config, resolve_path
from eagle3ft.drafter import dflash_export
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.dflash_config import DFlashConfig
from eagle3ft.drafter.folder import DrafterFolder, drafter_spec, read_spec


def dflash_section(**kw):
    cfg = load_config(REPO / "configs/tiny.yaml")
    return dataclasses.replace(cfg.drafter, config="configs/drafters/tiny-dflash.json", **kw)


def test_kind_by_architectures():
    assert isinstance(read_spec(REPO / "configs/drafters/tiny-dflash.json"), DFlashConfig)
    assert isinstance(read_spec(REPO / "configs/drafters/smollm2-135m-dflash.json"), DFlashConfig)
    assert isinstance(read_spec(REPO / "configs/drafters/tiny.json"), DrafterConfig)
    spec = drafter_spec(dflash_section(), resolve_path)
    assert isinstance(spec, DFlashConfig) and spec.target_layer_ids == [0, 1, 2] and spec.block_size == 4


def test_dflash_folder_checked_and_loaded(tmp_path):
    drafter = random_dflash(tiny_dflash_config()).float()
    dflash_export.save(drafter, tmp_path / "d")
    folder = DrafterFolder(tmp_path / "d", "warm start")
    assert folder.family == "dflash"
    eagle3 = {"hidden_size": 64, "vocab_size": 49152, "num_layers": 4, "aux_layer_ids": [0, 1, 2]}
    identity = {**eagle3, "capture": {"kind": "dflash", "hidden_states": [1, 2, 3]}}
    folder.check(identity, "manifest.json")
    with pytest.raises(ValueError, match="the features were harvested for an EAGLE-3 one"):
        folder.check(eagle3, "manifest.json")
    loaded = folder.load()
    for k, v in drafter.state_dict().items():
        assert (loaded.state_dict()[k] == v).all()
    with pytest.raises(ValueError, match=r"target_layer_ids \[0, 1, 2\] != the features' captured layers \[0, 1\]"):
        folder.check({**identity, "aux_layer_ids": [0, 1]}, "manifest.json")
    with pytest.raises(ValueError, match="is a dflash drafter; the EAGLE-3 trainer needs a eagle3 one"):
        folder.require("eagle3", "the EAGLE-3 trainer")


def test_mixes_refused_in_one_line(tmp_path):
    eagle = DrafterConfig.from_json(REPO / "configs/drafters/tiny.json")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text((REPO / "configs/drafters/tiny.json").read_text())
    assert eagle.architecture == "LlamaForCausalLMEagle3"
    with pytest.raises(ValueError) as e:
        drafter_spec(dflash_section(init=str(tmp_path / "e")), resolve_path)
    assert "is a eagle3 drafter but drafter.config" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="drafter.draft_vocab_size apply to EAGLE-3 drafters only"):
        drafter_spec(dflash_section(draft_vocab_size=64), resolve_path)
