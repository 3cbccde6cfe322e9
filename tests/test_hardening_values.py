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
