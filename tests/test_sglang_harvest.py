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


def move_hidden_rows(meta: dict, by: int) -> None:
    """A server's hidden-state rows (the prompt's block, then one per generated token) moved by `by` positions, their
    count kept: row t holds row t + by's state, the edge row repeated."""
    if meta.get("hidden_states"):
        block, flat = meta["hidden_states"][0], meta["hidden_states"][1:]
        rows = block + flat
        rows = rows[by:] + rows[-1:] * by if by > 0 else rows[:1] * -by + rows[:by]
        meta["hidden_states"] = [rows[: len(block)]] + rows[len(block) :]


class ShiftedEngine(DoubleEngine):
    """A server bug: every per-token row (hidden state and top-k) moved up by one position, their count kept."""

    def generate(self, req):
        out, timeline = super().generate(req)
        meta = out["meta_info"]
        move_hidden_rows(meta, 1)
        if meta.get("input_top_logprobs") is not None:
            inp, outp = meta["input_top_logprobs"], meta.get("output_top_logprobs") or []
            head = inp[:1] if inp and inp[0] is None else []
            entries = inp[len(head) :] + outp
            entries = entries[1:] + entries[-1:]
            n_in = len(inp) - len(head)
            meta["input_top_logprobs"], meta["output_top_logprobs"] = head + entries[:n_in], entries[n_in:]
        return out, timeline


class HiddenShiftedEngine(DoubleEngine):
    """A server bug the argmax check cannot see: the hidden-state rows alone moved by `by` positions (count kept), the
    top-k rows in place."""

    by = 1

    def generate(self, req):
        out, timeline = super().generate(req)
        move_hidden_rows(out["meta_info"], self.by)
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


@pytest.mark.parametrize("by, side", [(1, "after"), (-1, "before")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_hidden_rows_shifted_alone_are_refused_at_any_temperature(tmp_path, by, side, temperature):
    """The top-k rows in place, so the argmax check passes; the aux row check (data/aux_rows.py) refuses before
    anything is committed, and with it off the same server's rows go into the store."""
    cfg = load_config(REPO_ROOT / "configs/tiny.yaml")
    model, tok = load_target(cfg.target)
    engine = HiddenShiftedEngine(model, tok, aux_layer_ids=[0, 1, 2])
    engine.by = by
    sets = ("harvest.sources=[{kind: sharegpt, limit: 4}]", f"harvest.temperature={temperature}")
    with SGLangDouble(engine, version="0.5.23") as d:
        with pytest.raises(HarvestRefused, match=rf"aux layer 2 ranks the top-1 of the row {side} first on \d+ of"):
            run_harvest(sglang_config(d.url, *sets), tmp_path / "on")
        manifest = tmp_path / "on/features/manifest.json"
        assert not manifest.exists() or json.loads(manifest.read_text())["shards"] == []
        summary = run_harvest(sglang_config(d.url, *sets, "harvest.aux_row_check=skip"), tmp_path / "off")
    assert summary["aux_row_check"] == "off" and summary["samples"]["train"] > 0


def test_aux_row_counts_of_an_aligned_harvest_and_the_refusal_rule():
    from collections import Counter

    from eagle3ft.data.aux_rows import Lens, row_offsets, shifted

    # H = 2, V = 4: the lens reads h straight (norm weight 1, head = one-hot rows); row t points at top1[t]'s row
    head = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    lens = Lens(torch.ones(2), 1e-6, head)
    top1 = torch.tensor([0, 1, 2, 3, 0, 1])
    aligned = head[top1]
    assert row_offsets(aligned, top1, lens) == Counter(before=0, here=4, after=0)
    assert row_offsets(torch.cat([aligned[1:], aligned[-1:]]), top1, lens) == Counter(before=0, here=0, after=4)
    assert row_offsets(aligned, torch.tensor([0, 0, 1, 1, 2, 2]), lens) == Counter()  # no three distinct candidates
    assert shifted(Counter(before=10, here=40, after=14)) is None
    assert shifted(Counter(before=3, here=2, after=59)) == "after"
    assert shifted(Counter(before=30, here=20, after=14)) is None  # most, but not twice the row's own
    assert shifted(Counter(before=40, here=2, after=1)) is None  # too few rows to say


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


def test_the_aux_row_check_says_why_it_is_off_and_require_insists(tmp_path, monkeypatch):
    """It reads a served target's norm and head from safetensors alone: the model is never loaded for them."""
    from eagle3ft.config import TargetConfig
    from eagle3ft.data.aux_rows import row_checker
    from eagle3ft.targets import hf

    def no_load(cfg):
        raise AssertionError("the target was loaded")

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    served = TargetConfig(kind="hf", path=str(tmp_path))  # SGLang's dummy weights: a config.json and nothing else
    client = object()  # the SGLang backend: no model in this process
    monkeypatch.setattr(hf, "load_target", no_load)
    check, status = row_checker("auto", client, served, (0, 1, 2), 64)
    assert check is None and status == "off (the target's final norm and lm_head could not be read: FileNotFoundError)"
    with pytest.raises(ValueError, match="harvest.aux_row_check is require but the target's final norm and lm_head"):
        row_checker("require", client, served, (0, 1, 2), 64)
    assert row_checker("skip", client, served, (0, 1, 2), 64) == (None, "off")
    monkeypatch.undo()
    check, status = row_checker("require", client, load_config(REPO_ROOT / "configs/tiny.yaml").target, (0, 2, 1), 64)
    assert status == "layer 2" and check is not None
