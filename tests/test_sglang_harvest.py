"""The harvest job through SGLang (the protocol double) against the embedded backend, and its failure modes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from eagle3ft.config import REPO_ROOT, load_config
from eagle3ft.data.harvest import HarvestRefused, run_harvest
from eagle3ft.data.store import SPLITS, FeatureStore
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.targets.hf import load_target
from eagle3ft.targets.sglang_http import SGLangError

sys.path.insert(0, str(Path(__file__).parent))
from sglang_double import DoubleEngine, SGLangDouble  # noqa: E402

SMALL = [
    "harvest.sources=[{kind: sharegpt, limit: 6}, {kind: mtbench, limit: 2, split: heldout}]",
    "harvest.shard_samples=2",
    "harvest.batch_size=2",
]


def sglang_config(url: str, *extra: str):
    sets = SMALL + [
        "harvest.backend=sglang",
        f"harvest.sglang.urls=[{url}]",
        "harvest.sglang.retries=1",
        "harvest.sglang.backoff_s=0.01",
        *extra,
    ]
    return load_config(REPO_ROOT / "configs/tiny.yaml", sets)


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("hf")
    summary = run_harvest(load_config(REPO_ROOT / "configs/tiny.yaml", SMALL), run)
    return run, summary


def tiny_drafter(model):
    """A seeded random drafter of configs/drafters/tiny.json over the tiny target's embedding (what an EAGLE3 server
    drafts with)."""
    cfg = load_config(REPO_ROOT / "configs/tiny.yaml")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        d = Eagle3Drafter(DrafterConfig.from_json(REPO_ROOT / cfg.drafter.config))
    with torch.no_grad():
        d.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    return d.eval()


class ShiftedEngine(DoubleEngine):
    """A server bug: every per-token row (hidden state and top-k) moved up by one position, their count kept."""

    def generate(self, req):
        out, timeline = super().generate(req)
        meta = out["meta_info"]
        if meta.get("hidden_states"):
            block, flat = meta["hidden_states"][0], meta["hidden_states"][1:]
            rows = block + flat
            rows = rows[1:] + rows[-1:]
            meta["hidden_states"] = [rows[: len(block)]] + rows[len(block) :]
        if meta.get("input_top_logprobs") is not None:
            inp, outp = meta["input_top_logprobs"], meta.get("output_top_logprobs") or []
            head = inp[:1] if inp and inp[0] is None else []
            entries = inp[len(head) :] + outp
            entries = entries[1:] + entries[-1:]
            n_in = len(inp) - len(head)
            meta["input_top_logprobs"], meta["output_top_logprobs"] = head + entries[:n_in], entries[n_in:]
        return out, timeline


MODES = {
    "0.5.23-aux-capture": lambda model, tok: SGLangDouble(
        DoubleEngine(model, tok, aux_layer_ids=[0, 1, 2]), version="0.5.23"
    ),
    "0.5.17-eagle3": lambda model, tok: SGLangDouble(
        DoubleEngine(model, tok, drafter=tiny_drafter(model)), version="0.5.17"
    ),  # the recorded mode
}


@pytest.fixture(scope="module", params=list(MODES))
def double(request):
    cfg = load_config(REPO_ROOT / "configs/tiny.yaml")
    model, tok = load_target(cfg.target)
    d = MODES[request.param](model, tok).start()
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
    from eagle3ft.drafter.vocab import load_vocab

    d2t, t2d = load_vocab(run / "vocab.safetensors")
    return torch.cat([d2t, t2d.long()])


@pytest.mark.slow
def test_harvest_through_sglang_equals_embedded(embedded_run, double, tmp_path):
    run, ref = embedded_run
    summary = run_harvest(sglang_config(double.url, "harvest.sglang.capture=two_pass"), tmp_path)
    assert (
        summary["samples"] == ref["samples"] and summary["tokens"] == ref["tokens"] and summary["skips"] == ref["skips"]
    )
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


@pytest.mark.parametrize("capture", ["one_request", "two_pass"])
def test_a_server_that_shifts_its_rows_is_refused_at_t0(tmp_path, capture):
    """Rows shifted by one with their count kept pass every shape check; at T=0 the top-1 of each row is then
    not the token generated there, so the harvest refuses before committing anything."""
    cfg = load_config(REPO_ROOT / "configs/tiny.yaml")
    model, tok = load_target(cfg.target)
    with SGLangDouble(ShiftedEngine(model, tok, aux_layer_ids=[0, 1, 2]), version="0.5.23") as d:
        with pytest.raises(
            HarvestRefused,
            match=r"harvest refused at train chunk 0: \d+ of \d+ tokens generated at T=0 are not the target's argmax",
        ):
            run_harvest(
                sglang_config(
                    d.url, f"harvest.sglang.capture={capture}", "harvest.sources=[{kind: sharegpt, limit: 2}]"
                ),
                tmp_path,
            )
    manifest = (
        json.loads((tmp_path / "features" / "manifest.json").read_text())
        if (tmp_path / "features" / "manifest.json").exists()
        else {"shards": []}
    )
    assert manifest["shards"] == []


def test_argmax_check_counts_near_ties_and_mismatches():
    from eagle3ft.data.harvest import argmax_check

    # rows 2..5 predict the completion at positions 3..6; K = 3
    ids = torch.tensor([[0, 1, 2]] * 2 + [[7, 8, 9], [5, 4, 3], [6, 1, 2], [9, 8, 7]], dtype=torch.int32)
    lps = torch.tensor([[-0.1, -2.0, -3.0]] * 4 + [[-0.70, -0.72, -3.0], [-0.1, -2.0, -3.0]])
    got = argmax_check([7, 5, 1, 8], ids, lps, start=3, tie_eps=0.05)
    # 7: top-1; 5: top-1; 1: within 0.02 of the top-1 (a near-tie); 8: 1.9 below the top-1 (a mismatch)
    assert got == {"checked": 4, "mismatched": 1, "ties": 1}
    assert argmax_check([7, 5, 1, 8], ids, lps, start=3, tie_eps=0.0)["mismatched"] == 2
    assert argmax_check([11, 11, 11, 11], ids, lps, start=3, tie_eps=10.0)["mismatched"] == 4  # not in the top-k at all
