"""harvest.aux_dtype fp8: aux states stored as e4m3 with a scale per token and aux layer, read back as bf16."""

import pytest
import torch
from safetensors import safe_open
from test_data_store import TARGET, H, K, make_sample

from eagle3ft.config import HarvestConfig, load_config
from eagle3ft.data.harvest import check_harvest_config
from eagle3ft.data.store import FeatureStore, StoreError, dequantize_aux, quantize_aux
from eagle3ft.data.store_writer import FeatureWriter


def test_quantize_round_trip_is_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3 * H, generator=g) * torch.logspace(-3, 3, 64)[:, None]  # rows of very different sizes
    x[5, 2] = 3000.0  # an outlier far past e4m3's 448: its chunk gets its own scale
    x[7] = 0.0
    q, scale = quantize_aux(x.bfloat16(), H)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 3) and scale.dtype == torch.float32
    back = dequantize_aux(q, scale).float()
    assert back.dtype == torch.float32 and torch.isfinite(back).all() and torch.equal(back[7], x[7])
    amax = x.view(64, 3, H).abs().amax(-1, keepdim=True).expand(64, 3, H).reshape(64, 3 * H)
    err = (back - x).abs()
    assert (err <= x.abs() * 2**-4 + amax * 2**-8).all()  # 3 mantissa bits, plus the subnormal step near zero
    assert back[5, 2] == pytest.approx(3000.0, rel=2**-4)


def test_fp8_store_reads_back_as_bf16_and_is_smaller(tmp_path):
    g = torch.Generator().manual_seed(1)
    samples = [make_sample(i, 5 + i, g) for i in range(4)]
    sizes = {}
    for dtype in ("bf16", "fp8"):
        w = FeatureWriter(tmp_path / dtype, TARGET, K, True, "fp", aux_dtype=dtype)
        w.commit("train", 0, samples, {})
        w.finish(torch.zeros(100, dtype=torch.int64))
        sizes[dtype] = (tmp_path / dtype / "train-00000.safetensors").stat().st_size
    store = FeatureStore(tmp_path / "fp8")
    assert store.manifest["aux_dtype"] == "fp8"
    with safe_open(tmp_path / "fp8" / "train-00000.safetensors", framework="pt") as f:
        assert f.get_tensor("aux_hidden").dtype == torch.float8_e4m3fn and f.get_tensor("aux_scale").shape == (
            sum(len(s.input_ids) for s in samples),
            3,
        )
    tokens = sum(len(s.input_ids) for s in samples)
    assert sizes["bf16"] - sizes["fp8"] == pytest.approx(tokens * (3 * H * 2 - 3 * H - 12), abs=200)
    for item, s in zip(store.dataset("train"), samples):
        assert item["aux_hidden"].dtype == torch.bfloat16
        torch.testing.assert_close(item["aux_hidden"].float(), s.aux_hidden.float(), rtol=2**-4, atol=0.02)
        assert torch.equal(item["last_hidden"], s.last_hidden) and torch.equal(item["topk_ids"], s.topk_ids.long())
    assert "aux_hidden" not in store.dataset("train", keys=("input_ids", "loss_mask"))[0]


def test_aux_dtype_is_checked_and_never_mixed(tmp_path):
    FeatureWriter(tmp_path, TARGET, K, True, "fp", aux_dtype="fp8").commit(
        "train", 0, [], {}
    )  # the manifest is written
    with pytest.raises(StoreError, match="another aux_dtype"):
        FeatureWriter(tmp_path, TARGET, K, True, "fp")
    with pytest.raises(ValueError, match="harvest.aux_dtype 'int4'"):
        FeatureWriter(tmp_path / "x", TARGET, K, True, "fp", aux_dtype="int4")
    with pytest.raises(ValueError, match="harvest.aux_dtype: 'fp16' is not one of bf16, fp8"):
        load_config(None, ["harvest.aux_dtype=fp16"])
    with pytest.raises(ValueError, match="harvest.aux_dtype 'fp16'"):  # a config built in code
        check_harvest_config(HarvestConfig(aux_dtype="fp16"))
