"""Offline tau on the bench's own prompts and answers: the features are what the harvest-side test helper builds,
and the tau is eval/accept_len.py's on them, next to the live tau of the same greedy decodes."""

import pytest
import torch

from _eval_tiny import AUX, features, greedy_items, prompts, tiny_pair
from eagle3ft.eval.accept_len import evaluate
from eagle3ft.eval.economics import Setting
from eagle3ft.eval.same_prompts import features as bench_features
from eagle3ft.eval.same_prompts import offline_tau
from eagle3ft.eval.speculate import SpeculativeDecoder, greedy_decode


def test_features_match_the_reference_item():
    target, _ = tiny_pair()
    (p,) = prompts(1, seed=5)
    answer = greedy_decode(target, p, 12).tokens
    got, ref = bench_features(target, AUX, p, answer), features(target, p + answer, len(p))
    for k in ("input_ids", "loss_mask", "topk_ids"):
        assert torch.equal(got[k], ref[k]), k
    for k in ("aux_hidden", "topk_logprobs"):  # float32 log-softmax here, float64 in the reference
        assert torch.allclose(got[k].double(), ref[k], atol=1e-5), k


def test_offline_tau_on_the_bench_answers_tracks_the_live_tau():
    target, drafter = tiny_pair()
    ps = prompts(6, seed=1)[:3]  # prompts the drafter was fitted on: drafts are accepted often
    answers = [greedy_decode(target, p, 24).tokens for p in ps]
    res = offline_tau(target, drafter, AUX, ps, answers, [Setting(1, 1, 2), Setting(3, 1, 4)])
    ref = evaluate(drafter, greedy_items(target, ps, 24), 3, 1, 4, 0.0)
    assert res["settings"] == {k: v["tau"] for k, v in ref.settings.items()} and res["roots"] == ref.roots == sum(len(a) - 1 for a in answers)
    dec = SpeculativeDecoder(target, drafter, AUX, 3)
    gens = [dec.generate(p, 24) for p in ps]
    live = sum(sum(g.accept_lengths) for g in gens) / sum(g.verify_count for g in gens)
    assert res["settings"]["3/1/4"] > 1.3  # the fitted drafter is accepted often: the comparison is not 1 against 1
    assert res["settings"]["3/1/4"] == pytest.approx(live, rel=0.05)  # same tokens; only the cycle roots (and the last, cut cycle) differ
    assert offline_tau(target, drafter, AUX, ps, answers, [Setting(3, 2, 6)]) is None  # trees: no chain to score
