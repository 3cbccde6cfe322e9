"""The harvest job through SGLang (the protocol double) against the embedded backend, and its failure modes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from eagle3ft.data.config import REPO_ROOT, load_config
from eagle3ft.data.harvest import run_harvest
from eagle3ft.data.store import SPLITS, FeatureStore
from eagle3ft.data.targets.hf import load_target
from eagle3ft.data.targets.sglang import SGLangError

sys.path.insert(0, str(Path(__file__).parent))
from sglang_double import DoubleEngine, SGLangDouble  # noqa: E402

SMALL = ["harvest.sources=[{kind: sharegpt, limit: 6}, {kind: mtbench, limit: 2, split: heldout}]", "harvest.shard_samples=2", "harvest.batch_size=2"]


def sglang_config(url: str, *extra: str):
    sets = SMALL + ["harvest.backend=sglang", f"harvest.sglang.urls=[{url}]", "harvest.sglang.retries=1", "harvest.sglang.backoff_s=0.01", *extra]
    return load_config(REPO_ROOT / "configs/tiny.yaml", sets)


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("hf")
    summary = run_harvest(load_config(REPO_ROOT / "configs/tiny.yaml", SMALL), run)
    return run, summary


@pytest.fixture(scope="module")
def double():
    cfg = load_config(REPO_ROOT / "configs/tiny.yaml")
    model, tok = load_target(cfg.target)
    d = SGLangDouble(DoubleEngine(model, tok, aux_layer_ids=[0, 1, 2]), version="0.5.23").start()
    yield d
    d.stop()


def assert_same_store(a: Path, b: Path):
    sa, sb = FeatureStore(a / "features"), FeatureStore(b / "features")
    assert sa.manifest["counts"] == sb.manifest["counts"] and sa.target == sb.target
    for split in SPLITS:
        da, db = sa.dataset(split), sb.dataset(split)
        assert len(da) == len(db) > 0
        for x, y in zip(da, db):
            assert x["sample_id"] == y["sample_id"]
            assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
            torch.testing.assert_close(y["aux_hidden"].float(), x["aux_hidden"].float(), atol=1e-2, rtol=1e-2)
            assert torch.equal(x["topk_ids"], y["topk_ids"])
            torch.testing.assert_close(y["topk_logprobs"], x["topk_logprobs"], atol=1e-4, rtol=1e-4)
    assert torch.equal(sa.token_counts(), sb.token_counts())
    assert torch.equal(_vocab(a), _vocab(b))


def _vocab(run: Path) -> torch.Tensor:
    from eagle3ft.data.vocab import load_vocab

    d2t, t2d = load_vocab(run / "vocab.safetensors")
    return torch.cat([d2t, t2d.long()])


@pytest.mark.slow
def test_harvest_through_sglang_equals_embedded(embedded_run, double, tmp_path):
    run, ref = embedded_run
    summary = run_harvest(sglang_config(double.url, "harvest.sglang.capture=two_pass"), tmp_path)
    assert summary["samples"] == ref["samples"] and summary["tokens"] == ref["tokens"] and summary["skips"] == ref["skips"]
    assert_same_store(run, tmp_path)


@pytest.mark.slow
def test_failed_requests_leave_no_partial_shard_and_resume_completes(embedded_run, double, tmp_path):
    run, ref = embedded_run
    cfg = sglang_config(double.url, "harvest.sglang.capture=two_pass")
    double.faults.clear()
    double.faults.extend([None] * 9 + ["500"] * 2 + ["truncate"] * 2 + ["close"] * 50)  # fails in the 2nd or 3rd chunk
    with pytest.raises(SGLangError, match="after 2 attempts"):
        run_harvest(cfg, tmp_path)
    features = tmp_path / "features"
    manifest = json.loads((features / "manifest.json").read_text())
    listed = {s["file"] for s in manifest["shards"]}
    assert 0 < len(listed) < ref["chunks"]
    assert {p.name for p in features.iterdir()} == listed | {"manifest.json"}  # no partial shard, no temp file
    double.faults.clear()
    summary = run_harvest(cfg, tmp_path)
    assert summary["chunks_resumed"] == len(listed)
    assert_same_store(run, tmp_path)
