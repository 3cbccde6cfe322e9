"""A replay mix: each training source drawn as often as its weight (SourceConfig.weight), from the sources the
feature store records per sample."""

from collections import Counter

import pytest
from train_fixtures import REPO, write_store

from eagle3ft.config import load_config
from eagle3ft.data.store import StoreError
from eagle3ft.train.batching import epoch_order
from eagle3ft.train.data import TrainData

TINY = REPO / "configs/tiny.yaml"
SOURCES = "harvest.sources=[{kind: humaneval, name: code}, {kind: sharegpt, name: chat, weight: %s}]"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("mix")
    write_store(run, n_train=16, sources={"train": ("code", "chat"), "heldout": ("code",)})
    return run


def data(run, weight, *more) -> TrainData:
    return TrainData(load_config(TINY, [SOURCES % weight, *more]), run)


def test_weights_of_one_keep_the_plain_order(run):
    d = data(run, 1)
    assert d.weights is None and d.order(3) == epoch_order(16, 0, 3)
    assert {n: m["samples"] for n, m in d.mix.items()} == {"code": 8, "chat": 8}


def test_a_source_is_drawn_as_often_as_its_weight(run):
    d = data(run, 0.25)
    chat = [i for i, n in enumerate(d.sources) if n == "chat"]
    assert d.sources[:2] == ["code", "chat"] and len(chat) == 8
    draws = Counter()
    for epoch in range(200):
        order = d.order(epoch)
        assert order == d.order(epoch) and sorted(i for i in order if i not in chat) == [
            i for i in range(16) if i not in chat
        ]
        draws.update(i for i in order if i in chat)
    assert sum(draws.values()) / 200 == pytest.approx(8 * 0.25, rel=0.1)  # a quarter of the 8 per epoch
    assert len(draws) == 8  # every one of them over the epochs
    d2 = data(run, 2)
    assert Counter(d2.order(0)) == Counter({i: 2 if i in chat else 1 for i in range(16)})
    assert d2.order_len(0) == 24 and d2.micro_batches(0) == 24
    share = d.mix["chat"]["share"]
    tokens = {n: m["answer_tokens"] for n, m in d.mix.items()}
    assert share == pytest.approx(0.25 * tokens["chat"] / (0.25 * tokens["chat"] + tokens["code"]))


def test_packed_bins_hold_the_weighted_draws(run):
    d = data(run, 2, "train.batch.pack_tokens=64")
    assert Counter(i for b in d.bins(0) for i in b) == Counter(d.order(0))


def test_a_weight_on_a_source_with_no_samples_is_refused(run):
    with pytest.raises(StoreError, match="harvest.sources give general a weight, but no training sample is recorded"):
        TrainData(load_config(TINY, ["harvest.sources=[{kind: sharegpt, name: general, weight: 0.5}]"]), run)
    with pytest.raises(StoreError, match="every training sample's source weighs 0"):
        TrainData(load_config(TINY, [SOURCES.replace("name: code}", "name: code, weight: 0}") % 0]), run)
