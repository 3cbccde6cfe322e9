"""The repetition-loop definition (data/loops.py) and the live split built on it (eval/bench/live_splits.py), on hand-made
answers whose loops are known."""

import pytest

from eagle3ft.data.loops import MIN_RUN, NGRAM, loop_mask, repeated
from eagle3ft.eval.bench.live_splits import arm_figures, cut_at, spans_of, split_spans


def _answer() -> tuple[list[int], int, int]:
    """20 distinct tokens, then a 6-token phrase said 6 times: (ids, first loop token, its length). The 8-gram ending
    at token t repeats the one ending at t - 6 once both lie inside the phrases: t >= 20 + 6 + 8 - 1."""
    head = list(range(100, 120))
    phrase = [1, 2, 3, 4, 5, 6]
    ids = head + phrase * 6
    first = len(head) + len(phrase) + NGRAM - 1
    return ids, first, len(ids) - first


def test_a_known_loop_gives_known_counts():
    ids, first, n = _answer()
    mask = loop_mask(ids)
    assert mask == [False] * first + [True] * n
    assert sum(mask) == 23 and n >= MIN_RUN


def test_a_phrase_said_twice_is_no_loop():
    ids = list(range(50)) + list(range(10)) + list(range(200, 240))  # 10 tokens copied once: 3 repeated 8-grams
    assert sum(repeated(ids)) == 3
    assert not any(loop_mask(ids))


def test_spans_share_verifies_and_seconds_by_their_tokens():
    loop = [False, False, True, True]
    free, looped = split_spans(loop, [(1, 0.0, 0.0), (2, 1.0, 2.0), (1, 1.0, 1.0)])
    assert (free.tokens, free.verifies, free.seconds) == (2, 0.5, 1.0)
    assert (looped.tokens, looped.verifies, looped.seconds) == (2, 1.5, 2.0)


def _row(ids, rep, mode, verify=None, acc=None, cycle=None, finished=False, events=None, whole=None):
    return {
        "repetition": rep,
        "mode": mode,
        "prompt_index": 0,
        "new_tokens": len(ids),
        "output_ids": ids,
        "prefill_s": 0.01,
        "decode_s": 0.1 * (len(ids) - 1),
        "wall_s": 0.01 + 0.1 * (len(ids) - 1),
        "verify_count": verify,
        "accept_lengths": acc,
        "cycle_s": cycle,
        "finished": finished,
        "events": events,
        "whole": whole,
    }


def test_live_split_on_a_looping_speculative_answer():
    """An embedded answer: the prefill's token, verifies of 1 token before the loop, then verifies of 4 inside it.
    Loop-free tau counts the verifies over free tokens only; the loop's tau is the rest."""
    ids, first, n = _answer()
    acc = [1] * (first - 1) + [4] * (n // 4) + ([n % 4] if n % 4 else [])
    assert 1 + sum(acc) == len(ids)
    spec = _row(ids, 0, "speculative", verify=len(acc), acc=acc, cycle=[0.15] * len(acc))
    plain = _row(ids, 0, "baseline")
    f = arm_figures([spec], [plain])
    lf = f["loop_free"]
    assert lf["tokens"] == first and lf["loop_tokens"] == n
    assert lf["tau"] == 1.0  # the prefill's token is no verify's: 32 free tokens in 32 verifies
    assert abs(lf["tau_loops"] - 4.0) < 0.2
    assert lf["answers_looping"] == 1 and lf["unresolved"] == 0
    assert abs(lf["speedup_decode"] - (1 / 0.15) / (1 / 0.1)) < 1e-9  # free tokens: one per 0.15 s against 0.1 s
    assert f["all"]["tau"] == sum(acc) / len(acc)


def test_streamed_events_resolve_verifies_when_one_per_event():
    ids = list(range(10))
    r = _row(ids, 0, "speculative", verify=3, events=[[0.0, 1], [0.25, 4], [0.5, 7], [0.75, 10]])
    assert spans_of(r) == [(1, 0.0, 0.0), (3, 1.0, 0.25), (3, 1.0, 0.25), (3, 1.0, 0.25)]
    merged = _row(ids, 0, "speculative", verify=3, events=[[0.0, 1], [0.25, 4], [0.75, 10]])
    s = spans_of(merged)
    assert [round(v, 6) for _, v, _ in s] == [0.0, 1.0, 2.0]  # 3 verifies shared out by the events' seconds


def test_a_streamed_request_cut_at_a_shorter_cap():
    """Cut at 5 tokens: the verify that reaches the 5th token (the 3rd event) ends it, at its time plus the prefill;
    an answer already within the cap is kept whole, and a request with no events cannot be cut."""
    ids = list(range(10))
    whole = {"new_tokens": 10, "wall_s": 0.9, "output_ids": ids}
    r = _row(ids, 0, "speculative", verify=3, finished=True, events=[[0.0, 1], [0.25, 4], [0.5, 7], [0.75, 10]])
    r["whole"] = whole
    c = cut_at(r, 5)
    assert (c["new_tokens"], c["output_ids"], c["verify_count"]) == (5, ids[:5], 2)
    assert c["events"] == [[0.0, 1], [0.25, 4], [0.5, 5]] and c["wall_s"] == 0.01 + 0.5
    assert not c["finished"] and c["whole"] is None and r["events"][-1] == [0.75, 10]
    assert spans_of(c) == [(1, 0.0, 0.0), (3, 1.0, 0.25), (1, 1.0, 0.25)]
    same = cut_at(r, 10)
    assert same["finished"] and same["new_tokens"] == 10 and same["whole"] is None
    with pytest.raises(ValueError, match="no streamed events"):
        cut_at(_row(ids, 0, "baseline"), 5)


def test_finished_and_e2e_figures_pair_prompts_and_repetitions():
    whole_s = {"new_tokens": 10, "wall_s": 0.5, "output_ids": list(range(10)), "finished": True}
    whole_p = {"new_tokens": 10, "wall_s": 1.0, "output_ids": list(range(10)), "finished": True}
    spec = [_row(list(range(10)), k, "speculative", verify=3, finished=True, whole=whole_s) for k in range(3)]
    plain = [_row(list(range(10)), k, "baseline", finished=True, whole=whole_p) for k in range(3)]
    f = arm_figures(spec, plain)
    assert f["e2e"]["speedup_median"] == 2.0 and f["e2e"]["speedup_paired"]["median"] == 2.0
    assert f["finished"]["answers"] == 3 and f["finished"]["speedup_e2e"] == 2.0
    assert f["loop_free"]["unresolved"] == 3  # a non-streamed answer has no spans
    assert "non-streamed" in f["e2e"]["timing"]


def test_non_streamed_console_line_counts_looping_answers_and_gives_the_no_loop_figure():
    from eagle3ft.eval.bench.format import _format_figures

    loop = [1, 2, 3, 4] * 8  # loops from its 9th token on
    rows = [
        _row(ids, k, "speculative", verify=v, finished=True, whole={"new_tokens": len(ids), "wall_s": 0.5, "output_ids": ids})
        for k, (ids, v) in enumerate([(loop, 8), (list(range(32)), 16)])
    ]  # fmt: skip
    plain = [
        _row(ids, k, "baseline", finished=True, whole={"new_tokens": len(ids), "wall_s": 1.0, "output_ids": ids})
        for k, ids in enumerate([loop, list(range(32))])
    ]  # fmt: skip
    line = _format_figures(arm_figures(rows, plain), "")[1]
    assert "1 answers loop" in line  # not 0: the answers without spans are still looked at whole
    assert "no loop 1/2, tau 1.94, e2e x2.00" in line  # 31 tokens after the prefill's over 16 verifies
    assert "2 answers without spans" in line


def test_offline_walk_counts_a_cycle_by_its_share_of_loop_free_tokens():
    """accept_len's walk: the cycle at row i emits positions i+2 .. i+1+n; the loop-free figures count each cycle by
    the share of its tokens outside loops."""
    from eagle3ft.eval.offline.accept_len import _totals, _walk_fields

    loops = [False] * 6 + [True] * 6  # positions 6..11 loop
    cycles = [(0, 2), (2, 2), (4, 4), (8, 2)]  # positions 2-3, 4-5, 6-9, 10-11
    tokens, n, free_tokens, free_cycles = _totals(cycles, loops)
    assert (tokens, n, free_tokens, free_cycles) == (10, 4, 4.0, 2.0)
    f = _walk_fields([(tokens, n, free_tokens, free_cycles)])
    assert f["tau_walk"] == 2.5 and f["tau_walk_loop_free"] == 2.0 and f["loop_share_walk"] == 0.6
