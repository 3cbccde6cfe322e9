"""Values no stage lets through: non-finite or absurd config rates, NaN or inf drafter weights, bare NaN in JSON; and
the inputs no single record of which stops a stage: prompt records of any depth, size or type, damaged shards, a full
disk."""

from __future__ import annotations

import pytest
from train_fixtures import REPO

from eagle3ft.config import ConfigError, load_config

TINY = REPO / "configs/tiny.yaml"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=.inf", "train.lr must be a finite number, got inf"),
        ("train.lr=1e39", "train.lr must be <= 10, got 1e+39"),
        ("train.lr=.nan", "train.lr must be positive, got nan"),
        ("train.max_grad_norm=.inf", "train.max_grad_norm must be a finite number, got inf"),
        ("harvest.sglang.timeout_s=.inf", "harvest.sglang.timeout_s must be a finite number, got inf"),
        ("bench.temperature=-.inf", "bench.temperature must be >= 0, got -inf"),
    ],
)
def test_config_refuses_non_finite_and_absurd_rates_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert str(e.value) == message
    load_config(TINY, ["train.lr=10"])  # the largest rate let through


def nan_drafter():
    import torch

    from eagle3ft.drafter.config import DrafterConfig
    from eagle3ft.drafter.model import Eagle3Drafter

    torch.manual_seed(0)
    model = Eagle3Drafter(DrafterConfig.from_json(REPO / "configs/drafters/tiny.json"))
    with torch.no_grad():
        model.fc.weight[0, 0] = float("nan")
    return model


def test_an_export_or_checkpoint_is_never_written_with_a_non_finite_tensor(tmp_path):
    from eagle3ft.drafter.export import export_drafter
    from eagle3ft.files import NonFinite

    model = nan_drafter()
    with pytest.raises(
        NonFinite, match=r"/\.export\.tmp: tensor fc\.weight holds 1 non-finite value\(s\) \(NaN or inf\)"
    ):
        export_drafter(model, tmp_path / "export")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "model.safetensors").write_text("the last good export")
    with pytest.raises(NonFinite):
        export_drafter(model, tmp_path / "export")
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    assert (tmp_path / "export" / "model.safetensors").read_text() == "the last good export"
    from test_hardening_train import SavingDist

    from eagle3ft.train.checkpoint import save_checkpoint

    with pytest.raises(NonFinite, match=r"/ckpt/\.step-3\.tmp: tensor fc\.weight holds 1 non-finite"):
        save_checkpoint(SavingDist(), model, model.config, tmp_path, 3, {"step": 3}, keep=0)
    assert list((tmp_path / "ckpt").iterdir()) == []
