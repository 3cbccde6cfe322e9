"""train.loop_weight: the answers' repetition-loop tokens (data/loops.py) weighted or cut in the loss, on a token
store of hand-made samples trained online on the tiny target."""

import itertools
import json
from types import SimpleNamespace

import pytest
import torch
from test_train_ttt import batch as ttt_batch
from test_train_ttt import drafter

from eagle3ft.config import REPO_ROOT, ConfigError, load_config
from eagle3ft.data.loops import answer_loops
from eagle3ft.data.tokens import TokenSample, TokenWriter
from eagle3ft.train.data import TrainData
from eagle3ft.train.loop import open_logs
from eagle3ft.train.ttt import ttt_forward

TINY = REPO_ROOT / "configs" / "tiny.yaml"
PROMPT = [11, 12, 13, 14, 15]
FREE = list(range(100, 130))  # 30 distinct tokens: no 8-gram twice
LOOPING = list(range(200, 210)) + [301, 302, 303] * 10  # 10 free tokens, then a period-3 copy for 30


class OneRank:
    device = torch.device("cpu")

    def prepare_loader(self, loader, skip_batches=0):
        return itertools.islice(loader, skip_batches, None)


def sample(turns: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[int]]:
    ids, mask = [], []
    for prompt, answer in turns:
        ids += prompt + answer
        mask += [0] * len(prompt) + [1] * len(answer)
    return ids, mask


# (ids, mask) per sample: one loop-free answer; two turns, the second looping; a loop-free answer said twice, which
# loops only if the two answers were taken as one
SAMPLES = [
    sample([(PROMPT, FREE)]),
    sample([(PROMPT, FREE[:12]), (PROMPT, LOOPING)]),
    sample([(PROMPT, FREE[:20]), (PROMPT, FREE[:20])]),
]
# LOOPING: the first 8-gram wholly in the copy ends at its position 17 and recurs 3 later, so positions 20..39 are
# repeated, one run of 20 >= 8 (the 8-grams ending at 10..16 hold a free token, 17..19 are first occurrences)
LOOP_AT = {1: [len(PROMPT) + 12 + len(PROMPT) + t for t in range(20, 40)]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("loopweight")
    writer = TokenWriter(run / "tokens", {"target": "tiny"}, "test")
    writer.commit("train", 0, [TokenSample(i, ids, mask) for i, (ids, mask) in enumerate(SAMPLES)])
    writer.finish()
    return run


def cfg(*overrides):
    return load_config(TINY, ["train.data.features=online", "train.batch.micro_batch_size=3", *overrides])


def batches(run, *overrides):
    data = TrainData(cfg(*overrides), run)
    return data, list(data.epoch(OneRank(), 0))


def by_sample(mb, key):
    """{sample id: its row of `key`, cut to the sample's length} of a padded micro-batch."""
    return {s: mb.tensors[key][b, : len(SAMPLES[s][0])] for b, s in enumerate(mb.sample_ids)}


def test_answer_loops_hand_values():
    for i, (ids, mask) in enumerate(SAMPLES):
        got = answer_loops(ids, mask)
        assert [t for t, x in enumerate(got) if x] == LOOP_AT.get(i, []), i
    ids, mask = SAMPLES[2]
    assert any(answer_loops(ids, [1] * len(ids)))  # one answer of both turns would loop: each turn is taken apart


def test_loop_weight_one_leaves_batches_unchanged(run):
    _, plain = batches(run)
    data, one = batches(run, "train.objective.loop_weight=1.0")
    assert data.loop_tokens is None and len(plain) == len(one) == 1
    assert sorted(one[0].tensors) == sorted(plain[0].tensors) and "loss_weight" not in one[0].tensors
    for key, want in plain[0].tensors.items():
        assert torch.equal(one[0].tensors[key], want), key
    stored = by_sample(one[0], "loss_mask")
    assert all(stored[s].tolist() == SAMPLES[s][1] for s in stored)


def test_loop_weight_zero_cuts_exactly_the_loop_tokens(run):
    data, cut = batches(run, "train.objective.loop_weight=0")
    assert data.loop_tokens == 20 and "loss_weight" not in cut[0].tensors
    for s, got in by_sample(cut[0], "loss_mask").items():
        want = list(SAMPLES[s][1])
        for t in LOOP_AT.get(s, []):
            want[t] = 0
        assert got.tolist() == want, s


def test_fractional_loop_weight_weights_the_loop_tokens(run):
    data, weighted = batches(run, "train.objective.loop_weight=0.25")
    assert data.loop_tokens == 20
    t = weighted[0].tensors
    for s, got in by_sample(weighted[0], "loss_mask").items():
        assert got.tolist() == SAMPLES[s][1]  # the mask stays; the weight rides beside it
    for s, got in by_sample(weighted[0], "loss_weight").items():
        want = [float(m) for m in SAMPLES[s][1]]
        for pos in LOOP_AT.get(s, []):
            want[pos] = 0.25
        assert got.tolist() == want, s
    assert t["loss_weight"].dtype == torch.float32


def test_weighted_loss_is_the_weighted_mean_of_the_two_parts():
    """Per step: (w·n_loop·L_loop + n_free·L_free) / (w·n_loop + n_free), the parts' means and counts taken from
    unweighted unrolls whose loss_mask keeps one part alone; weight 1 everywhere is the unweighted loss."""
    m, b = drafter(seed=3), ttt_batch(seed=4, T=14)
    loop = torch.zeros_like(b["loss_mask"])
    loop[0, 4:10] = loop[1, 7:12] = 1
    w = 0.25
    plain = ttt_forward(m, b, steps=3, decay=0.8)
    ones = ttt_forward(m, {**b, "loss_weight": b["loss_mask"].float()}, steps=3, decay=0.8)
    torch.testing.assert_close(ones.loss, plain.loss)
    weight = b["loss_mask"].float() * torch.where(loop.bool(), w, 1.0)
    got = ttt_forward(m, {**b, "loss_weight": weight}, steps=3, decay=0.8)
    in_loop = ttt_forward(m, {**b, "loss_mask": b["loss_mask"] * loop}, steps=3, decay=0.8)
    free = ttt_forward(m, {**b, "loss_mask": b["loss_mask"] * (1 - loop)}, steps=3, decay=0.8)
    assert (in_loop.valid > 0).all() and (free.valid > 0).all()
    want = (w * in_loop.valid * in_loop.step_loss + free.valid * free.step_loss) / (w * in_loop.valid + free.valid)
    torch.testing.assert_close(got.step_loss, want)
    torch.testing.assert_close(got.loss, sum(0.8**k * want[k] for k in range(3)))
    assert torch.equal(got.valid, plain.valid)  # the counts stay unweighted
    assert not torch.allclose(got.loss, plain.loss)


def test_data_summary_gives_the_loop_tokens_and_their_share(run, tmp_path, capsys):
    data = TrainData(cfg("train.objective.loop_weight=0.5"), run)
    log = tmp_path / "train" / "metrics.jsonl"
    fake = SimpleNamespace(
        cfg=data.cfg, dist=SimpleNamespace(print=print), metrics_file=log, step=0, data=data, total=1, l2sp=None
    )
    open_logs(fake, 1000)
    summary = json.loads((tmp_path / "train" / "data.json").read_text())
    answers = sum(sum(mask) for _, mask in SAMPLES)
    assert (summary["loop_weight"], summary["loop_tokens"], summary["answer_tokens"]) == (0.5, 20, answers)
    assert f"20 of them ({20 / answers:.1%}) in loops weighted 0.5" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["-0.1", "1.5"])
def test_loop_weight_outside_0_1_is_refused(bad):
    with pytest.raises(ConfigError, match="loop_weight must be"):
        cfg(f"train.objective.loop_weight={bad}")


def test_packed_rows_carry_the_weights(run):
    """Packed micro-batches (train.pack_tokens) carry loss_weight as the padded ones do: 0 on the padding."""
    _, packed = batches(run, "train.objective.loop_weight=0.25", "train.batch.pack_tokens=256")
    answers = sum(sum(mask) for _, mask in SAMPLES)
    assert len(packed) == 1 and packed[0].tensors["loss_weight"].shape == (1, 256)
    assert packed[0].tensors["loss_weight"].sum().item() == pytest.approx(answers - 20 + 20 * 0.25)
