"""A DFlash drafter served and priced: SGLang's DFLASH flags from its folder, and the block cycle's cost (one drafter
forward for the whole block, a verify of B tokens) beside EAGLE-3's chain."""

from __future__ import annotations

import dataclasses

import pytest
from dflash_fixtures import random_dflash, tiny_dflash_config

from eagle3ft.config import REPO_ROOT, load_config
from eagle3ft.drafter import dflash_export
from eagle3ft.eval.economics.cost_model import CostModel
from eagle3ft.setting import Setting
from eagle3ft.targets.sglang_server import LaunchError, build_command


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_dflash_speculative_command(tmp_path):
    dflash_export.save(random_dflash(tiny_dflash_config(block_size=4)).float(), tmp_path / "export")
    cfg = load_config(REPO_ROOT / "configs/smollm2-135m.yaml", ["serve.model_path=/models/smol"])
    cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, attention_backend=None))
    argv = build_command(cfg, "speculative", drafter=tmp_path / "export", setting=Setting(3, 1, 4)).argv
    assert flag(argv, "--speculative-algorithm") == "DFLASH"
    assert flag(argv, "--speculative-draft-model-path") == str(tmp_path / "export")
    assert flag(argv, "--speculative-num-draft-tokens") == "4" and flag(argv, "--attention-backend") == "triton"
    assert "--speculative-num-steps" not in argv and "--speculative-eagle-topk" not in argv
    with pytest.raises(LaunchError, match="setting 3/1/3 must be 3/1/4"):
        build_command(cfg, "speculative", drafter=tmp_path / "export", setting=Setting(3, 1, 3))
    dflash_cfg = load_config(
        REPO_ROOT / "configs/smollm2-135m.yaml",
        ["serve.model_path=/models/smol", "drafter.config=configs/drafters/smollm2-135m-dflash.json"],
    )
    with pytest.raises(LaunchError, match=r"loaded with --speculative-draft-load-format dummy"):
        build_command(dflash_cfg, "harvest")  # no capture draft named: drafter.init is no EAGLE-3 folder
    capture = "configs/drafters/smollm2-135m-dflash-capture"
    argv = build_command(
        dataclasses.replace(dflash_cfg, serve=dataclasses.replace(dflash_cfg.serve, harvest_draft=capture)), "harvest"
    ).argv
    assert flag(argv, "--speculative-algorithm") == "EAGLE3" and flag(argv, "--speculative-draft-model-path").endswith(
        capture
    )
    with pytest.raises(LaunchError, match=r"captures layers \[1, 8, 14, 20, 27\], drafter.config .* needs \[0, 1, 2\]"):
        tiny = load_config(
            REPO_ROOT / "configs/tiny.yaml",
            [
                "serve.model_path=/models/tiny",
                "drafter.config=configs/drafters/tiny-dflash.json",
                f"serve.harvest_draft={capture}",
            ],
        )
        build_command(tiny, "harvest")
    aux = load_config(
        REPO_ROOT / "configs/tiny.yaml",
        [
            "serve.model_path=/models/tiny",
            "drafter.config=configs/drafters/tiny-dflash.json",
            "serve.harvest_capture=aux_flag",
            "serve.sglang_version=0.5.23",
        ],
    )
    argv = build_command(aux, "harvest").argv
    assert argv[argv.index("--return-aux-hidden-state-layer-ids") + 1 :][:3] == ["0", "1", "2"]


def test_block_cycle_is_one_draft_forward():
    costs = dict(baseline_s_per_token=0.010, verify_s={4: 0.012, 16: 0.016}, draft_forward_s=0.004, overhead_s=0.001)
    eagle, block = CostModel(**costs), CostModel(**costs, block=True)
    assert eagle.cycle_s(Setting(3, 1, 4)) == pytest.approx(3 * 0.004 + 0.012 + 0.001)
    assert block.cycle_s(Setting(3, 1, 4)) == pytest.approx(0.004 + 0.012 + 0.001)
    assert block.cycle_s(Setting(15, 1, 16)) == pytest.approx(0.004 + 0.016 + 0.001)  # flat in B but the verify
    assert block.break_even_tau(Setting(15, 1, 16)) == pytest.approx(2.1)
