"""Online features and packed batches (train/data.py, train/batching.py) on the tiny target: online == offline batch for batch,
packing keeps every sample once and within budget, a packed batch trains exactly as one sample per row, and
online packed training runs through the real entry point and resumes at the exact data position."""

import itertools
import json

import pytest
import torch
from test_train_ttt import batch as ttt_batch
from test_train_ttt import drafter
from train_fixtures import launch

from eagle3ft.config import REPO_ROOT, load_config
from eagle3ft.data.harvest import run_harvest
from eagle3ft.data.store import StoreError
from eagle3ft.data.tokens import TokenSample, TokenWriter
from eagle3ft.drafter.vocab import build_vocab, load_vocab, save_vocab
from eagle3ft.train.batching import collate_packed, pack_bins, sample_spans
from eagle3ft.train.data import TrainData
from eagle3ft.train.ttt import ttt_forward

TINY = REPO_ROOT / "configs" / "tiny.yaml"


class OneRank:
    """What TrainData.epoch needs of train/dist.py's Dist, for one process without a process group."""

    device = torch.device("cpu")

    def prepare_loader(self, loader, skip_batches=0):
        return itertools.islice(loader, skip_batches, None)


def tiny_cfg(*overrides):
    return load_config(
        TINY,
        [
            "harvest.sources=[{kind: sharegpt, limit: 6}, {kind: mtbench, limit: 2, split: heldout}]",
            "harvest.max_new_tokens=8",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def harvested(tmp_path_factory):
    run = tmp_path_factory.mktemp("online")
    run_harvest(tiny_cfg(), run)
    return run


def epoch_batches(cfg, run, epoch=0, skip=0):
    return list(TrainData(cfg, run).epoch(OneRank(), epoch, skip))


# --------------------------------------------------------------------------- online == offline


@pytest.mark.parametrize(
    "layout", [("train.batch.micro_batch_size=3",), ("train.batch.pack_tokens=96", "train.batch.max_len=80")]
)
def test_online_batches_equal_the_stores(harvested, layout):
    offline = epoch_batches(tiny_cfg(*layout), harvested)
    online = epoch_batches(tiny_cfg("train.data.features=online", *layout), harvested)
    assert len(offline) == len(online) > 1
    for off, on in zip(offline, online):
        assert on.sample_ids == off.sample_ids and on.tokens == off.tokens
        assert sorted(on.tensors) == sorted(off.tensors)
        for key, want in off.tensors.items():
            got = on.tensors[key]
            assert got.dtype == want.dtype and got.shape == want.shape, key
            if key == "topk_logprobs":
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            elif key == "aux_hidden":  # bf16 in both: one rounding step apart at most
                torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-5)
            else:
                assert torch.equal(got, want), key


def write_tokens(run, harvested):
    """RUN/tokens holding the harvested train samples' ids and masks (what data/regen.py writes)."""
    data = TrainData(tiny_cfg(), harvested)
    writer = TokenWriter(run / "tokens", {"target": "tiny"}, "test")
    writer.commit(
        "train",
        0,
        [
            TokenSample(s["sample_id"], s["input_ids"].tolist(), s["loss_mask"].tolist())
            for s in map(data.dataset.__getitem__, range(len(data)))
        ],
    )
    writer.finish()


def test_online_fp8_aux_equals_an_fp8_store(harvested, tmp_path_factory):
    """harvest.aux_dtype=fp8 online gives the aux states an fp8 feature store reads back (e4m3, a scale per token
    and aux layer), not the bf16 ones."""
    fp8_run = tmp_path_factory.mktemp("online-fp8")
    run_harvest(tiny_cfg("harvest.aux_dtype=fp8"), fp8_run)
    layout = ("train.batch.pack_tokens=96", "train.batch.max_len=80")
    stored = epoch_batches(tiny_cfg("harvest.aux_dtype=fp8", *layout), fp8_run)
    online = epoch_batches(tiny_cfg("harvest.aux_dtype=fp8", "train.data.features=online", *layout), fp8_run)
    online_bf16 = epoch_batches(tiny_cfg("train.data.features=online", *layout), fp8_run)
    real = torch.cat([b.tensors["attention_mask"].reshape(-1).bool() for b in stored])
    aux = {
        name: torch.cat([b.tensors["aux_hidden"].reshape(-1, b.tensors["aux_hidden"].shape[-1]) for b in run])[real]
        for name, run in (("stored", stored), ("online", online), ("bf16", online_bf16))
    }
    # the same fp8 values, but where the online bf16 prefill rounds a value across an fp8 step
    assert (aux["online"] == aux["stored"]).float().mean() > 0.99
    assert (aux["bf16"] == aux["stored"]).float().mean() < 0.5  # fp8 is not bf16: the check can tell them apart


def test_max_answer_tokens_takes_nested_seeded_subsets(harvested):
    """train.max_answer_tokens: whole samples of one seeded order until their answer tokens reach the limit; the
    subset of a smaller limit lies inside that of a larger one, and training sees only the subset."""
    full = TrainData(tiny_cfg("train.batch.micro_batch_size=1"), harvested)
    assert (
        full.answer_tokens
        == full.all_answer_tokens
        == sum(int(full.dataset[i]["loss_mask"].sum()) for i in range(len(full)))
    )
    ids = {}
    for limit in (1, full.all_answer_tokens // 2, 10**9):
        data = TrainData(tiny_cfg("train.batch.micro_batch_size=1", f"train.data.max_answer_tokens={limit}"), harvested)
        ids[limit] = {data.dataset[i]["sample_id"] for i in range(len(data))}
        assert data.all_answer_tokens == full.all_answer_tokens
        assert data.answer_tokens == sum(int(data.dataset[i]["loss_mask"].sum()) for i in range(len(data)))
        assert {s for b in data.epoch(OneRank(), 0) for s in b.sample_ids} == ids[limit]
    half = full.all_answer_tokens // 2
    assert len(ids[1]) == 1 and ids[1] < ids[half] < ids[10**9]
    assert len(ids[10**9]) == len(full)
    with pytest.raises(ValueError, match="max_answer_tokens must be positive"):
        TrainData(tiny_cfg("train.data.max_answer_tokens=0"), harvested)


def test_online_reads_the_token_store_when_there_is_one(harvested, tmp_path):
    """RUN/tokens (data/tokens.py) is the online token source; its samples get the target's features."""
    write_tokens(tmp_path, harvested)
    save_vocab(
        tmp_path / "vocab.safetensors", *build_vocab(torch.zeros(49152, dtype=torch.int64), 512)
    )  # as from an empty train split
    cfg = tiny_cfg("train.data.features=online", "train.batch.micro_batch_size=2")
    data = TrainData(cfg, tmp_path)
    assert data.where == str(tmp_path / "tokens") and data.store is None
    for new, harvest in zip(load_vocab(tmp_path / "vocab.safetensors"), load_vocab(harvested / "vocab.safetensors")):
        assert torch.equal(
            new, harvest
        )  # rewritten from the tokens it trains on: the harvest's counts of the same samples
    got = next(iter(data.epoch(OneRank(), 0)))
    want = next(iter(TrainData(tiny_cfg("train.batch.micro_batch_size=2"), harvested).epoch(OneRank(), 0)))
    assert got.sample_ids == want.sample_ids
    torch.testing.assert_close(got.tensors["topk_logprobs"], want.tensors["topk_logprobs"], rtol=1e-4, atol=1e-5)


def test_more_token_stores_train_after_run_tokens_and_must_match_its_identity(harvested, tmp_path):
    """train.more_tokens: a second store's train samples follow RUN/tokens' (e.g. a sampled pass over the same
    prompts); one of another target is refused, and so is the key without online training."""
    write_tokens(tmp_path / "run", harvested)
    write_tokens(tmp_path / "second", harvested)
    one = TrainData(tiny_cfg("train.data.features=online"), tmp_path / "run")
    both = TrainData(
        tiny_cfg("train.data.features=online", f"train.data.more_tokens=[{tmp_path / 'second' / 'tokens'}]"),
        tmp_path / "run",
    )
    assert len(both) == 2 * len(one) and both.answer_tokens == 2 * one.answer_tokens
    assert [both.dataset[i]["input_ids"].tolist() for i in range(len(one), len(both))] == [
        one.dataset[i]["input_ids"].tolist() for i in range(len(one))
    ]
    assert both.where == f"{tmp_path / 'run' / 'tokens'} + {tmp_path / 'second' / 'tokens'}"
    manifest = tmp_path / "second" / "tokens" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["identity"] = {"target": "another"}
    manifest.write_text(json.dumps(m))
    with pytest.raises(StoreError, match="another target"):
        TrainData(
            tiny_cfg("train.data.features=online", f"train.data.more_tokens=[{manifest.parent}]"), tmp_path / "run"
        )
    with pytest.raises(ValueError, match="online training only"):
        TrainData(tiny_cfg(f"train.data.more_tokens=[{manifest.parent}]"), harvested)


def test_online_without_any_store_names_both(tmp_path):
    with pytest.raises(Exception, match="neither a token store"):
        TrainData(tiny_cfg("train.data.features=online"), tmp_path)


def test_bad_train_features_and_pack_tokens_are_refused(harvested):
    with pytest.raises(ValueError, match="train.data.features: 'disk' is not one of offline, online"):
        tiny_cfg("train.data.features=disk")
    with pytest.raises(ValueError, match="train.batch.pack_tokens must be positive"):
        TrainData(tiny_cfg("train.batch.pack_tokens=0"), harvested)


# --------------------------------------------------------------------------- packing


def test_pack_bins_are_first_fit_decreasing_deterministic_and_complete():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 300, (500,), generator=g).tolist()
    bins = pack_bins(lengths, 512, seed=3, epoch=0)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 512) * 11 // 9 + 1  # FFD's bound against the optimum
    assert bins == pack_bins(lengths, 512, seed=3, epoch=0)
    assert bins != pack_bins(lengths, 512, seed=3, epoch=1)
    small = [5, 4, 3, 2, 2]  # by hand: 5 -> bin 0, 4 -> bin 1, 3 -> bin 1, 2 -> bin 0, 2 -> bin 2
    assert sorted([small[i] for i in b] for b in pack_bins(small, 7, 0, 0)) == [[2], [4, 3], [5, 2]]


def test_collate_packed_layout_and_spans():
    items = [
        {"sample_id": 7, "input_ids": torch.arange(1, 5), "loss_mask": torch.ones(4, dtype=torch.long)},
        {"sample_id": 9, "input_ids": torch.arange(10, 16), "loss_mask": torch.ones(6, dtype=torch.long)},
    ]
    b = collate_packed(items, budget=12, cap=5)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 10, 11, 12, 13, 14, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2]]
    assert b["attention_mask"].tolist() == [[1] * 9 + [0] * 3]
    assert b["loss_mask"][0, 9:].tolist() == [0, 0, 0] and b["sample_id"].tolist() == [7, 9]
    assert sample_spans(b) == [(0, 4), (4, 5)]


@pytest.mark.parametrize("attention", ["flash", "lse"])
def test_packed_batch_trains_as_one_sample_per_row(monkeypatch, attention):
    """Same loss, counts and gradients (fp32): attention and TTT targets stay inside each document."""
    from eagle3ft.train import attention as attn

    monkeypatch.setattr(attn, "ATTENTION", attention)
    m = drafter(seed=3)
    params = [p for p in m.parameters() if p.requires_grad]
    lens = [10, 7, 4, 9]
    rows = ttt_batch(B=len(lens), T=10, seed=4)
    for i, n in enumerate(lens):
        for v in rows.values():
            v[i, n:] = 0
    rows["attention_mask"] = (torch.arange(10) < torch.tensor(lens)[:, None]).long()
    items = [
        {"sample_id": i, **{k: v[i, :n] for k, v in rows.items() if k != "attention_mask"}} for i, n in enumerate(lens)
    ]
    packed = collate_packed(items, budget=40, cap=10)
    packed.pop("sample_id")
    ref = ttt_forward(m, rows, steps=4)
    out = ttt_forward(m, packed, steps=4)
    ref_grads = torch.autograd.grad(ref.loss, params)
    grads = torch.autograd.grad(out.loss, params)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=1e-6)
    for name in ("step_loss", "correct", "valid", "chain_correct", "chain_valid"):
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen flash runs on CUDA")
def test_packed_varlen_flash_matches_rows_on_cuda():
    """bf16 packed rows through varlen flash against fp32 one sample per row (the exact SDPA path), on CUDA."""
    import copy

    lens = [64, 40, 17, 100, 3]
    rows = {k: v.cuda() for k, v in ttt_batch(B=len(lens), T=100, seed=4).items()}
    for i, n in enumerate(lens):
        for v in rows.values():
            v[i, n:] = 0
    items = [
        {"sample_id": i, **{k: v[i, :n] for k, v in rows.items() if k != "attention_mask"}} for i, n in enumerate(lens)
    ]
    packed = {k: v.cuda() for k, v in collate_packed(items, budget=256, cap=100).items() if k != "sample_id"}
    ref_model = drafter(seed=3).cuda()
    model = copy.deepcopy(ref_model).bfloat16()
    ref, out = ttt_forward(ref_model, rows, steps=4), ttt_forward(model, packed, steps=4)
    ref_grads = torch.autograd.grad(ref.loss, [p for p in ref_model.parameters() if p.requires_grad])
    grads = torch.autograd.grad(out.loss, [p for p in model.parameters() if p.requires_grad])
    assert out.valid.tolist() == ref.valid.tolist()
    torch.testing.assert_close(out.loss.float(), ref.loss, rtol=2e-2, atol=0)
    for g, r in zip(grads, ref_grads):
        assert (g.float() - r).norm() <= 3e-2 * r.norm() + 1e-6


# --------------------------------------------------------------------------- the real entry point


def metrics(run):
    return [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_online_packed_training_runs_and_resumes_exactly(harvested, tmp_path):
    """2 CPU ranks, online features from a token store alone (its vocab built on the way), packed rows: each rank
    its own bins; a stop + resume sees the same samples."""
    common = (
        "train.data.features=online",
        "train.batch.pack_tokens=128",
        "train.batch.max_len=96",
        "train.schedule.max_steps=4",
        "train.checkpoint.save_every=2",
        "train.schedule.warmup_steps=1",
        "train.objective.ttt_steps=2",
    )
    straight, split = tmp_path / "straight", tmp_path / "split"
    for run in (straight, split):
        run.mkdir()
        write_tokens(run, harvested)
    r = launch(straight, *common)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = metrics(straight)
    assert [x["step"] for x in rows] == [1, 2, 3, 4] and all(x["tokens"] > 0 and x["tokens_per_s"] > 0 for x in rows)
    for x in rows:  # two ranks, each its own bins
        a, b = x["samples"]
        assert a and b and not set(a) & set(b)
        assert x["online_prefill_s"] > 0  # the target's prefill, timed
        if x["step"] % 2 == 0:  # it runs between steps (no such span right after a checkpoint, every 2 steps)
            assert x["online_prefill_s"] <= x["phase_s"]["between"], x
    assert (straight / "export" / "model.safetensors").is_file() and (straight / "vocab.safetensors").is_file()
    r = launch(split, *common, "train.schedule.stop_after=2")
    assert r.returncode == 0, r.stderr[-4000:]
    r = launch(split, *common, extra=("--resume", "auto"))
    assert r.returncode == 0, r.stderr[-4000:]
    assert [x["samples"] for x in metrics(split)] == [x["samples"] for x in rows]


def test_online_heldout_tau_equals_the_offline_one(harvested):
    """Held-out τ while training online: the target's features of the held-out tokens give the counts that the
    stored held-out features give (TrainData.heldout feeding train/validate.py's heldout_tau)."""
    from eagle3ft.train.build import build_drafter
    from eagle3ft.train.ttt import TTTObjective
    from eagle3ft.train.validate import heldout_batches, heldout_tau

    results = []
    for mode in ("offline", "online"):
        cfg = tiny_cfg(f"train.data.features={mode}", "train.batch.micro_batch_size=2")
        data = TrainData(cfg, harvested)
        ds, _, features, _ = data.heldout(torch.device("cpu"))
        assert len(ds) == 2 and (features is None) == (mode == "offline")
        torch.manual_seed(0)
        objective = TTTObjective(build_drafter(cfg.drafter, cfg.target, harvested, data.target), 3, 0.8)
        results.append(heldout_tau(objective, heldout_batches(ds, 8, 0, 1, 2, None), 3, features=features))
    off, on = results
    assert on.heldout_tokens == off.heldout_tokens > 0 and sum(off.chain_valid) > 0
    assert on.chain_valid == off.chain_valid and on.chain_correct == off.chain_correct
