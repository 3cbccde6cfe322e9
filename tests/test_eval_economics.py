"""The economics worked example and the predicted-vs-measured join."""

import pytest

from eagle3ft.eval.economics import CostModel, Setting, analyse, format_table

S324 = Setting(steps=2, topk=1, num_draft_tokens=3)


def test_worked_example():
    # A 29 ms draft+verify cycle over 3 tokens; 82 tok/s plain decoding (12.195 ms per token).
    cm = CostModel(baseline_s_per_token=1 / 82, verify_s={3: 0.029})
    assert cm.tok_per_s(2.0, S324) == pytest.approx(68.97, abs=0.01)
    assert round(cm.tok_per_s(2.0, S324)) == 69
    assert round(cm.break_even_tau(S324), 2) == 2.38
    assert round(cm.tau_for(150, S324), 2) == 4.35
    assert cm.tok_per_s(cm.break_even_tau(S324), S324) == pytest.approx(cm.baseline_tok_s)
    # The brief's 12.1 ms/token is 82.6 tok/s, whose break-even is 29/12.1 = 2.40, not 2.38.
    assert round(CostModel(0.0121, {3: 0.029}).break_even_tau(S324), 2) == 2.40


def test_cycle_includes_draft_forwards_and_interpolates_verify():
    cm = CostModel(baseline_s_per_token=0.010, verify_s={1: 0.010, 5: 0.014}, draft_forward_s=0.002, overhead_s=0.001)
    s = Setting(steps=3, topk=1, num_draft_tokens=4)
    assert cm.verify_time(4) == pytest.approx(0.013)
    assert cm.verify_time(9) == pytest.approx(0.014)
    assert cm.cycle_s(s) == pytest.approx(3 * 0.002 + 0.013 + 0.001)
    assert cm.break_even_tau(s) == pytest.approx(2.0)


def test_analyse_picks_best_and_reports_predictions():
    summary = {
        "costs": {"baseline_s_per_token": 0.01, "verify_s": {"3": 0.012, "4": 0.013, "6": 0.02}, "draft_forward_s": 0.002, "overhead_s": 0.0},
        "speculative": [
            {"setting": {"steps": 2, "topk": 1, "num_draft_tokens": 3}, "tau": 2.2, "tok_s_median": 130.0, "cycle_s": 0.016},
            {"setting": {"steps": 3, "topk": 1, "num_draft_tokens": 4}, "tau": 2.8, "tok_s_median": 140.0, "cycle_s": 0.019},
            {"setting": {"steps": 5, "topk": 1, "num_draft_tokens": 6}, "tau": 2.9, "tok_s_median": 96.0, "cycle_s": 0.030},
        ],
    }
    ec = analyse(summary, {"3/1/4": 2.5})
    by = {r.setting: r for r in ec.settings}
    assert by["3/1/4"].cycle_ms == pytest.approx(19.0)
    assert by["3/1/4"].predicted_tok_s_live_tau == pytest.approx(2.8 / 0.019)
    assert by["3/1/4"].predicted_tok_s_offline_tau == pytest.approx(2.5 / 0.019)
    assert by["2/1/3"].predicted_tok_s_offline_tau is None
    assert by["5/1/6"].break_even_tau == pytest.approx(3.0)
    assert ec.best_setting == "3/1/4" and ec.best_basis == "live"
    assert "3/1/4" in format_table(ec)
    # an offline tau for a setting never benchmarked is priced with the interpolated verify cost
    (off,) = [r for r in analyse(summary, {"4/1/5": 3.0}).offline_predictions]
    assert off["cycle_ms"] == pytest.approx(4 * 2 + 16.5) and off["predicted_tok_s"] == pytest.approx(3.0 / 0.0245)
