"""Feature store round trip, checks, and the draft vocabulary."""

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3ft.data.store import SCHEMA_VERSION, FeatureStore, StoreError, collate
from eagle3ft.data.store_writer import FeatureWriter, Sample
from eagle3ft.drafter.vocab import build_vocab, check_vocab, load_vocab, save_vocab, vocab_from_drafter
from eagle3ft.files import DamagedFile

H, K = 8, 4
TARGET = {"name": "t", "hidden_size": H, "vocab_size": 100, "num_layers": 4, "aux_layer_ids": [0, 1, 2]}


def make_sample(sid: int, T: int, g: torch.Generator) -> Sample:
    return Sample(
        sample_id=sid,
        input_ids=torch.randint(0, 100, (T,), generator=g, dtype=torch.int32),
        loss_mask=(torch.rand(T, generator=g) > 0.5).to(torch.uint8),
        aux_hidden=torch.randn(T, 3 * H, generator=g).to(torch.bfloat16),
        topk_ids=torch.randint(0, 100, (T, K), generator=g, dtype=torch.int32),
        topk_logprobs=-torch.rand(T, K, generator=g).sort(-1).values,
        last_hidden=torch.randn(T, H, generator=g).to(torch.bfloat16),
    )


@pytest.fixture
def store_dir(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = FeatureWriter(tmp_path, TARGET, K, True, "fp")
    train = [make_sample(10 + i, 3 + i, g) for i in range(5)]
    held = [make_sample(99, 7, g)]
    w.commit("train", 0, train[:3], {"too_long": 1})
    w.commit("train", 1, train[3:], {})
    w.commit("heldout", 0, held, {})
    w.commit("heldout", 1, [], {"nonfinite_features": 2})
    w.finish(torch.arange(100), {"skips": {"too_long": 1, "nonfinite_features": 2}})
    return tmp_path, train, held


def test_round_trip(store_dir):
    path, train, held = store_dir
    store = FeatureStore(path)
    m = store.manifest
    assert m["schema_version"] == SCHEMA_VERSION and store.target == TARGET and store.topk == K
    assert m["counts"]["train"]["samples"] == 5 and m["counts"]["heldout"]["samples"] == 1
    assert m["counts"]["train"]["tokens"] == sum(len(s.input_ids) for s in train)
    assert m["chunk_skips"] == {"too_long": 1, "nonfinite_features": 2}
    assert [s["file"] for s in m["shards"]] == [
        "train-00000.safetensors",
        "train-00001.safetensors",
        "heldout-00000.safetensors",
    ]
    with safe_open(path / "train-00000.safetensors", framework="pt") as f:
        assert f.get_tensor("input_ids").dtype == torch.int32 and f.get_tensor("loss_mask").dtype == torch.uint8
        assert f.get_tensor("aux_hidden").dtype == torch.bfloat16 and f.get_tensor("offsets").tolist() == [0, 3, 7, 12]
    ds = store.dataset("train")
    assert len(ds) == 5 and len(store.dataset("heldout")) == 1
    for item, s in zip(ds, train):
        assert item["sample_id"] == s.sample_id
        assert torch.equal(item["input_ids"], s.input_ids.long()) and item["input_ids"].dtype == torch.long
        assert torch.equal(item["loss_mask"], s.loss_mask.long())
        assert torch.equal(item["aux_hidden"], s.aux_hidden) and torch.equal(item["last_hidden"], s.last_hidden)
        assert torch.equal(item["topk_ids"], s.topk_ids.long()) and torch.equal(item["topk_logprobs"], s.topk_logprobs)
    assert torch.equal(store.token_counts(), torch.arange(100))


def test_collate_pads_and_truncates(store_dir):
    path, train, _ = store_dir
    ds = FeatureStore(path).dataset("train")
    batch = collate([ds[0], ds[4]], max_len=6)  # lengths 3 and 7
    assert batch["input_ids"].shape == (2, 6) and batch["aux_hidden"].shape == (2, 6, 3 * H)
    assert batch["topk_logprobs"].shape == (2, 6, K) and batch["last_hidden"].shape == (2, 6, H)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]
    assert batch["loss_mask"][0, 3:].sum() == 0
    assert torch.equal(batch["input_ids"][1], train[4].input_ids[:6].long())
    assert batch["sample_id"].tolist() == [10, 14]
    loader = torch.utils.data.DataLoader(ds, batch_size=2, collate_fn=collate, num_workers=1)
    assert sum(b["input_ids"].shape[0] for b in loader) == 5


def test_reader_rejects_bad_stores(store_dir, tmp_path_factory):
    path, _, _ = store_dir
    with pytest.raises(StoreError, match="no feature store"):
        FeatureStore(tmp_path_factory.mktemp("empty"))
    shard = path / "train-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="sha256"):
        FeatureStore(path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["schema_version"] = SCHEMA_VERSION + 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="schema_version"):
        FeatureStore(path)


def test_writer_resumes_and_refuses_other_harvests(store_dir):
    path, _, _ = store_dir
    w = FeatureWriter(path, TARGET, K, True, "fp")
    assert w.done("train") == {0, 1} and w.done("heldout") == {0, 1}
    with pytest.raises(StoreError, match="already committed"):
        w.commit("train", 0, [], {})
    with pytest.raises(StoreError, match="fingerprint"):
        FeatureWriter(path, TARGET, K, True, "another order")
    with pytest.raises(StoreError, match="topk"):
        FeatureWriter(path, TARGET, K + 1, True, "fp")


def test_build_vocab_takes_the_most_frequent_sorted_by_id():
    counts = torch.zeros(20, dtype=torch.int64)
    counts[[3, 17, 5, 9]] = torch.tensor([10, 50, 10, 1])
    d2t, t2d = build_vocab(counts, 3)  # 17 (50), then the tie 3/5 (10 each)
    assert (torch.arange(3) + d2t).tolist() == [3, 5, 17]
    assert t2d.nonzero().flatten().tolist() == [3, 5, 17] and d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    d2t, t2d = build_vocab(counts, 6)  # 4 seen tokens, then the lowest unseen ids
    assert (torch.arange(6) + d2t).tolist() == [0, 1, 3, 5, 9, 17]
    check_vocab(d2t, t2d, 20, 6)
    with pytest.raises(ValueError):
        build_vocab(counts, 21)


def test_vocab_from_drafter_is_unchanged(tmp_path):
    from safetensors.torch import save_file

    d2t = torch.tensor([0, 4, 4, 10], dtype=torch.int64)  # target ids 0, 5, 6, 13: not a top-k of anything
    t2d = torch.zeros(16, dtype=torch.bool)
    t2d[[0, 5, 6, 13]] = True
    save_file({"fc.weight": torch.zeros(2, 2), "d2t": d2t, "t2d": t2d}, str(tmp_path / "model.safetensors"))
    got_d2t, got_t2d = vocab_from_drafter(tmp_path)
    assert torch.equal(got_d2t, d2t) and torch.equal(got_t2d, t2d)
    save_vocab(tmp_path / "vocab.safetensors", got_d2t, got_t2d)
    assert all(torch.equal(a, b) for a, b in zip(load_vocab(tmp_path / "vocab.safetensors"), (d2t, t2d)))
    with pytest.raises(ValueError, match="disagree"):
        check_vocab(d2t, ~t2d & (torch.arange(16) < 4), 16, 4)


def test_truncated_manifest_and_vocab_are_named(store_dir, tmp_path_factory):
    path, _, _ = store_dir
    manifest = path / "manifest.json"
    text = manifest.read_bytes()
    manifest.write_bytes(text[: len(text) // 2])
    for open_it in (lambda: FeatureStore(path), lambda: FeatureWriter(path, TARGET, K, True, "fp")):
        with pytest.raises(
            DamagedFile,
            match=rf"{manifest}: the feature store's manifest is not valid JSON \(.*\); the file is truncated or "
            r"damaged",
        ) as e:
            open_it()
        assert "\n" not in str(e.value)
    d = tmp_path_factory.mktemp("vocab")
    d2t, t2d = build_vocab(torch.arange(100), 10)
    save_vocab(d / "vocab.safetensors", d2t, t2d)
    data = (d / "vocab.safetensors").read_bytes()
    (d / "vocab.safetensors").write_bytes(data[:-7])
    with pytest.raises(
        DamagedFile,
        match=rf"{d / 'vocab.safetensors'}: the draft vocabulary is not a readable safetensors file .*truncated",
    ):
        load_vocab(d / "vocab.safetensors")
    save_file({"d2t": d2t}, str(d / "half.safetensors"))
    with pytest.raises(ValueError, match=r"half\.safetensors: the draft vocabulary has no t2d"):
        load_vocab(d / "half.safetensors")


@pytest.mark.parametrize(
    "entry",
    [
        "../outside.safetensors",
        "/etc/outside.safetensors",
        "sub/train-00000.safetensors",
        ".hidden.safetensors",
        "manifest.json",
    ],
)
def test_manifest_entries_cannot_point_outside_the_store(store_dir, entry):
    path, _, _ = store_dir
    outside = path.parent / "outside.safetensors"
    outside.write_bytes((path / "train-00000.safetensors").read_bytes())
    m = json.loads((path / "manifest.json").read_text())
    m["shards"][0]["file"] = entry
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(
        StoreError,
        match=rf"entry '{re.escape(entry)}' is not a \*\.safetensors file name inside {re.escape(str(path))}",
    ):
        FeatureStore(path, verify=False)
    m["shards"][0]["file"] = "train-00000.safetensors"
    m["token_counts"] = "../outside.safetensors"
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"entry '\.\./outside\.safetensors'"):
        FeatureStore(path, verify=False)


def test_writer_lists_damaged_committed_shards(store_dir):
    path, _, _ = store_dir
    w = FeatureWriter(path, TARGET, K, True, "fp")
    assert w.damaged() == []
    shard = path / "train-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    (path / "heldout-00000.safetensors").unlink()
    assert w.damaged() == ["train-00001.safetensors: fails its sha256 check", "heldout-00000.safetensors: missing"]


def _vocab(target_ids: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = torch.tensor(target_ids) - torch.arange(len(target_ids))
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[[t for t in target_ids if 0 <= t < vocab]] = True
    return d2t, t2d


def test_check_vocab_names_each_inconsistency():
    check_vocab(*_vocab([1, 4, 7], 10), 10, 3)
    with pytest.raises(
        ValueError, match=r"w: d2t maps 1 draft ids outside the target vocab \[0, 10\), first draft id 2 -> 12"
    ):
        check_vocab(*_vocab([1, 4, 12], 10), 10, 3, "w")
    with pytest.raises(ValueError, match="outside the target vocab"):
        check_vocab(*_vocab([-1, 4, 7], 10), 10, 3)
    with pytest.raises(ValueError, match="several draft ids to one target id"):
        check_vocab(*_vocab([4, 4, 7], 10), 10, 3)
    d2t, t2d = _vocab([1, 4, 7], 10)
    t2d[9] = True
    with pytest.raises(ValueError, match="t2d marks 4 target ids, d2t maps 3"):
        check_vocab(d2t, t2d, 10, 3)
    t2d[4] = False
    with pytest.raises(
        ValueError, match=r"disagree: 1 draft ids map to target ids t2d does not mark, first draft id 1 -> 4"
    ):
        check_vocab(d2t, t2d, 10, 3)
    with pytest.raises(ValueError, match="vocab sizes"):
        check_vocab(*_vocab([1, 4, 7], 10), 10, 4)
    with pytest.raises(ValueError, match="t2d must be a 1-D bool"):
        check_vocab(d2t, t2d.long(), 10, 3)
