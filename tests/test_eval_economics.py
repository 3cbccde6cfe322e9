"""The economics worked example, the predicted-vs-measured join, out-of-reach tau, and calibration across runs."""

import json

import pytest

from eagle3ft.config import load_config
from eagle3ft.eval.economics.analysis import analyse, format_table, main, read_offline_tau
from eagle3ft.eval.economics.calibration import (
    CalibrationError,
    calibration_from_summary,
    format_prediction,
    from_config,
    join,
    load_calibration,
    predict,
)
from eagle3ft.eval.economics.cost_model import CostModel, max_tau, reach, reach_text
from eagle3ft.eval.report import build
from eagle3ft.setting import Setting

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
        "costs": {
            "baseline_s_per_token": 0.01,
            "verify_s": {"3": 0.012, "4": 0.013, "6": 0.02},
            "draft_forward_s": 0.002,
            "overhead_s": 0.0,
        },
        "speculative": [
            {
                "setting": {"steps": 2, "topk": 1, "num_draft_tokens": 3},
                "tau": 2.2,
                "tok_s_median": 130.0,
                "cycle_s": 0.016,
            },
            {
                "setting": {"steps": 3, "topk": 1, "num_draft_tokens": 4},
                "tau": 2.8,
                "tok_s_median": 140.0,
                "cycle_s": 0.019,
            },
            {
                "setting": {"steps": 5, "topk": 1, "num_draft_tokens": 6},
                "tau": 2.9,
                "tok_s_median": 96.0,
                "cycle_s": 0.030,
            },
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


# --------------------------------------------------------------------------- out of reach


def test_tau_out_of_reach_names_the_setting_that_would_be_needed():
    cm = CostModel(baseline_s_per_token=1 / 82, verify_s={3: 0.029})
    r = reach(cm, 150, S324)
    # 150 tok/s needs tau 4.35 at 2/1/3, but a 2/1/3 cycle emits at most 3 tokens
    assert round(r["tau_needed"], 2) == 4.35 and r["max_tau"] == 3 and not r["reachable"]
    # deeper chains cost the same 29 ms here (verify flat beyond 3 tokens): 4/1/5 is the first whose max (5) covers 4.35
    assert r["needed_setting"] == "4/1/5" and r["extrapolated"]
    text = reach_text(r)
    assert "out of reach" in text and "at most 3" in text and "4/1/5" in text and "extrapolated" in text
    ok = reach(cm, 82, S324)  # break-even: tau 2.38 fits under 3
    assert ok["reachable"] and ok["speedup"] == pytest.approx(1.0) and "within its maximum 3" in reach_text(ok)
    assert (
        max_tau(Setting(3, 1, 4)) == 4 and max_tau(Setting(5, 4, 3)) == 3
    )  # a tree verifies num_draft_tokens - 1 drafts


def test_reach_says_when_no_chain_can_reach():
    cm = CostModel(baseline_s_per_token=0.01, verify_s={2: 0.01, 9: 0.1}, draft_forward_s=0.01)
    r = reach(cm, 1000, S324)
    assert not r["reachable"] and r["needed_setting"] is None and "no chain up to 8/1/9" in reach_text(r)


# --------------------------------------------------------------------------- calibration: predict, then compare


def _summary(
    base_s_per_token: float, rows: list[tuple[str, float, float, float]], backend="embedded", device="cpu: X"
) -> dict:
    """rows: (key, tau live, tok/s median, mean cycle s)."""
    spec = []
    for key, tau, tok_s, cycle in rows:
        st, tk, n = map(int, key.split("/"))
        spec.append(
            {
                "setting": {"steps": st, "topk": tk, "num_draft_tokens": n},
                "key": key,
                "tau": tau,
                "tok_s_median": tok_s,
                "speedup_median": tok_s * base_s_per_token,
                "cycle_s": cycle * 0.9,
                "cycle_s_per_pass": cycle,
            }
        )
    return {
        "backend": backend, "environment": {"device": device, "torch": "2.11"}, "max_new_tokens": 64,
        "prompts": {"source": {"kind": "mtbench", "limit": 8}, "count": 8},
        "baseline": {"tok_s_median": 1 / base_s_per_token},
        "costs": {"baseline_s_per_token": base_s_per_token, "verify_s": {"3": 0.012, "4": 0.013},
                  "draft_forward_s": 0.002, "overhead_s": 0.0},
        "speculative": spec,
    }  # fmt: skip


def test_calibration_predicts_a_later_run_from_offline_tau_alone(tmp_path):
    # run A (any drafter): mean cycles 16 ms at 2/1/3 and 20 ms at 3/1/4, plain decoding 10 ms/token
    a = _summary(0.010, [("2/1/3", 1.5, 1.5 / 0.016, 0.016), ("3/1/4", 1.6, 1.6 / 0.020, 0.020)])
    cal_path = tmp_path / "a" / "bench" / "calibration.json"
    cal_path.parent.mkdir(parents=True)
    cal_path.write_text(json.dumps(calibration_from_summary(a, "runs/a", target="smol")))
    cal = load_calibration(cal_path)
    assert cal["settings"]["3/1/4"]["cycle_s"] == 0.020  # the mean cycle, not the per-cycle median (0.018)

    # run B (a better drafter): offline tau only, no benchmark yet
    offline = {"1/1/2": 1.8, "3/1/4": 2.6}
    pred = predict(cal, offline)
    by = {r["setting"]: r for r in pred["rows"]}
    assert by["3/1/4"]["predicted_tok_s"] == pytest.approx(2.6 / 0.020) and by["3/1/4"]["cycle_basis"] == "measured"
    assert by["3/1/4"]["predicted_speedup"] == pytest.approx(1.3) and by["3/1/4"]["break_even_tau"] == pytest.approx(
        2.0
    )
    # 1/1/2 never ran in A: priced with A's cost model, 1 draft forward + the verify of 2 (flat below 3: 12 ms)
    assert by["1/1/2"]["cycle_basis"] == "cost model" and by["1/1/2"]["cycle_ms"] == pytest.approx(14.0)

    # B's benchmark arrives: 125 tok/s measured at 3/1/4 with live tau 2.55
    b = _summary(0.0105, [("3/1/4", 2.55, 125.0, 0.0204)], device="cpu: Y")
    j = join(pred, b, target="smol")
    r = {x["setting"]: x for x in j["rows"]}["3/1/4"]
    assert r["measured_tok_s"] == 125.0 and r["error_pct"] == pytest.approx(100 * (130 - 125) / 125)
    assert r["predicted_tok_s_live_tau"] == pytest.approx(2.55 / 0.020) and r["error_pct_live_tau"] == pytest.approx(
        100 * (127.5 - 125) / 125
    )
    assert r["speedup_error_pct"] == pytest.approx(100 * (1.3 - 125 * 0.0105) / (125 * 0.0105))
    # the predicted x1.3 at B's own plain 95.2 tok/s: 123.8 against 125, with no speculative figure of B in it
    assert r["predicted_tok_s_at_plain"] == pytest.approx(1.3 / 0.0105)
    assert r["error_pct_at_plain"] == pytest.approx(100 * (1.3 / 0.0105 - 125) / 125)
    assert "at this run's plain speed -1.0%" in format_prediction(join(pred, b, target="smol"))
    assert "measured_tok_s" not in {x["setting"]: x for x in j["rows"]}["1/1/2"]
    assert j["warnings"] == ["device differs: calibration 'cpu: X', this run 'cpu: Y'"]
    # plain decoding ran 100 tok/s in A and 95.2 in B: 5% of every setting's tok/s error is the host's, not the drafter's
    assert j["baseline"]["error_pct"] == pytest.approx(100 * (100 - 1 / 0.0105) / (1 / 0.0105))
    assert "plain decoding: 100.0 tok/s in the calibration, 95.2 here (+5.0%" in format_prediction(j)

    ec = analyse(b, offline, cal, target="smol")
    assert ec.calibrated["rows"] == j["rows"] and "error +4.0%" in format_table(ec)


def test_the_speed_up_is_predicted_in_plain_steps_and_held_to_the_paired_speed_up():
    # the calibration's 3/1/4 cycle cost 2.5 of its own repetitions' plain steps (a slow spell of the host slowed both)
    a = _summary(0.010, [("3/1/4", 1.6, 1.6 / 0.020, 0.020)])
    a["speculative"][0]["cycle_plain_steps"] = 2.5
    cal = {**calibration_from_summary(a, "runs/a"), "path": "runs/a/bench/calibration.json"}
    assert cal["settings"]["3/1/4"]["cycle_plain_steps"] == 2.5
    r = predict(cal, {"3/1/4": 3.0})["rows"][0]
    assert r["predicted_speedup"] == pytest.approx(1.2) and r["break_even_tau"] == 2.5  # not 0.020 / 0.010 = 2
    assert r["predicted_tok_s"] == pytest.approx(3.0 / 0.020)  # tok/s still from the cycle in seconds
    b = _summary(0.010, [("3/1/4", 2.9, 140.0, 0.021)])
    b["speculative"][0]["speedup_paired"] = {"median": 1.25, "min": 1.2, "max": 1.3, "per_repetition": [1.2, 1.25, 1.3]}
    m = join(predict(cal, {"3/1/4": 3.0}), b)["rows"][0]
    assert m["measured_speedup"] == 1.25 and m["measured_speedup_basis"] == "paired"
    assert m["speedup_error_pct"] == pytest.approx(100 * (1.2 - 1.25) / 1.25)
    del b["speculative"][0]["speedup_paired"]  # a summary from before: the median over the median
    m = join(predict(cal, {"3/1/4": 3.0}), b)["rows"][0]
    assert m["measured_speedup"] == pytest.approx(1.4) and m["measured_speedup_basis"] == "median over median"


def test_the_prediction_prices_the_offline_taus_interval_and_says_whether_the_measurement_fell_in_it(tmp_path):
    a = _summary(0.010, [("3/1/4", 1.6, 1.6 / 0.020, 0.020), ("8/4/32", 2.0, 80.0, 0.025)])
    cal = {**calibration_from_summary(a, "runs/a"), "path": "runs/a/bench/calibration.json"}
    pred = predict(cal, {"3/1/4": 3.0, "8/4/32": 4.0}, intervals={"3/1/4": [2.7, 3.3], "8/4/32": [3.6, 4.4]})
    by = {r["setting"]: r for r in pred["rows"]}
    assert by["3/1/4"]["predicted_tok_s_interval"] == [pytest.approx(135.0), pytest.approx(165.0)]
    b = _summary(0.010, [("3/1/4", 2.9, 140.0, 0.021), ("8/4/32", 3.5, 141.0, 0.025)])
    j = join(pred, b)
    by = {r["setting"]: r for r in j["rows"]}
    assert by["3/1/4"]["measured_in_interval"] and not by["8/4/32"]["measured_in_interval"]  # 141 < 3.6 / 0.025
    text = format_prediction(j)
    assert "tau offline 3.00 (2.70-3.30) x cycle 20.00 ms (measured) -> 150.0 tok/s (135.0-165.0)" in text
    assert "inside the range" in text and "outside the range" in text
    assert predict(cal, {"3/1/4": 3.0})["rows"][0]["predicted_tok_s_interval"] is None  # no interval, no range
    # eval/economics/analysis.py reads the intervals from RUN/eval/accept_len.json, beside the walk
    acc = tmp_path / "accept_len.json"
    acc.write_text(json.dumps({"settings": {"3/1/4": {"tau": 3.4, "tau_walk": 3.0, "tau_walk_interval": [2.7, 3.3]}}}))
    assert read_offline_tau(acc)[2] == {"3/1/4": [2.7, 3.3]}


def test_the_economics_picks_the_best_predicted_speed_up_among_the_settings_the_calibration_ran():
    # 2/1/3 at 2.0 plain steps, 5/4/8 at 2.6: the tree pays more at its offline tau; 1/1/2 only has the cost model
    a = _summary(0.010, [("2/1/3", 1.5, 75.0, 0.020), ("5/4/8", 2.0, 77.0, 0.026)])
    a["speculative"][0]["cycle_plain_steps"], a["speculative"][1]["cycle_plain_steps"] = 2.0, 2.6
    cal = {**calibration_from_summary(a, "runs/a"), "path": "runs/a/bench/calibration.json"}
    pred = predict(cal, {"1/1/2": 1.9, "2/1/3": 2.2, "5/4/8": 3.25})
    assert pred["pick"]["setting"] == "5/4/8" and pred["pick"]["predicted_speedup"] == pytest.approx(1.25)
    assert pred["pick"]["break_even_tau"] == 2.6 and "measured_speedup" not in pred["pick"]
    by = {r["setting"]: r for r in pred["rows"]}
    assert by["1/1/2"]["cycle_basis"] == "cost model"  # priced, but never the pick: no run measured its cycle
    b = _summary(0.010, [("2/1/3", 2.1, 100.0, 0.021), ("5/4/8", 3.1, 120.0, 0.025)])
    b["speculative"][1]["speedup_paired"] = {"median": 1.2, "min": 1.1, "max": 1.3, "per_repetition": [1.1, 1.2, 1.3]}
    j = join(pred, b)
    assert j["pick"]["measured_speedup"] == 1.2 and j["pick"]["tau_live"] == 3.1
    assert (
        "the economics picks 5/4/8: predicted x1.25, where it breaks even at tau 2.60 (offline 3.25); measured "
        "x1.20 at live tau 3.10" in format_prediction(j)
    )


def test_load_calibration_names_the_file(tmp_path):
    with pytest.raises(CalibrationError, match="nope.json: no such calibration file"):
        load_calibration(tmp_path / "nope.json")
    bad = tmp_path / "summary.json"
    bad.write_text(json.dumps({"costs": {}}))
    with pytest.raises(CalibrationError, match="summary.json: not a schema-1 calibration file"):
        load_calibration(bad)
    broken = tmp_path / "cut.json"
    broken.write_text('{"schema": 1, "cos')
    with pytest.raises(CalibrationError, match="cut.json: not a calibration file"):
        load_calibration(broken)


def test_economics_entry_point_predicts_before_the_bench_and_compares_after(tmp_path, capsys):
    a = _summary(0.010, [("3/1/4", 1.6, 80.0, 0.020)])
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    (run_a / "bench").mkdir(parents=True)
    (run_a / "bench" / "summary.json").write_text(json.dumps(a))
    main(["--config", "configs/tiny.yaml", "--run-dir", str(run_a), "--tok-s", "400"])
    out = capsys.readouterr().out
    assert "400.0 tok/s (x4.00) needs tau 7.60 at 3/1/4: out of reach" in out  # cost model: 3 x 2 + 13 ms
    assert (run_a / "bench" / "calibration.json").is_file()

    (run_b / "eval").mkdir(parents=True)
    (run_b / "eval" / "accept_len.json").write_text(json.dumps({"settings": {"3/1/4": {"tau": 2.4}}}))
    cal = ["--set", f"bench.calibration={run_a / 'bench' / 'calibration.json'}"]
    main(["--config", "configs/tiny.yaml", "--run-dir", str(run_b), *cal])
    assert "-> 120.0 tok/s (x1.20)" in capsys.readouterr().out
    pred = json.loads((run_b / "bench" / "prediction.json").read_text())
    assert pred["made_before_bench"] and pred["rows"][0]["predicted_tok_s"] == pytest.approx(120.0)

    (run_b / "bench" / "summary.json").write_text(json.dumps(_summary(0.010, [("3/1/4", 2.3, 110.0, 0.021)])))
    main(["--config", "configs/tiny.yaml", "--run-dir", str(run_b), *cal])
    assert "measured 110.0 (x1.10), error +9.1%" in capsys.readouterr().out
    econ = json.loads((run_b / "bench" / "economics.json").read_text())
    assert econ["calibrated"]["rows"][0]["error_pct"] == pytest.approx(100 * 10 / 110)
    assert json.loads((run_b / "bench" / "prediction.json").read_text())[
        "made_before_bench"
    ]  # still the one made before
    main(
        [
            "--config",
            "configs/tiny.yaml",
            "--run-dir",
            str(run_b),
            "--set",
            f"bench.calibration={run_b / 'bench' / 'calibration.json'}",
        ]
    )
    assert "warning: the calibration comes from this very run" in capsys.readouterr().out


def _cal_file(path, summary, steps: dict[str, float], prompts: int, target="smol"):
    for r in summary["speculative"]:
        r["cycle_plain_steps"] = steps[r["key"]]
    summary["prompts"]["count"] = prompts
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration_from_summary(summary, str(path.parent.parent), target=target)))
    return path


def test_a_pool_averages_each_settings_cycle_in_plain_steps_by_prompts_and_prices_it_at_the_latest_plain_step(
    tmp_path, capsys
):
    # two earlier runs on a faster host (8 ms a plain step) and the latest on a slower one (10 ms): 3/1/4 cost
    # 2.4 plain steps over 40 prompts, 2.6 over 16, and 2.8 in the latest's 16
    early1 = _cal_file(
        tmp_path / "e1/bench/calibration.json", _summary(0.008, [("3/1/4", 1.6, 80, 0.0192)]), {"3/1/4": 2.4}, 40
    )
    early2 = _cal_file(
        tmp_path / "e2/bench/calibration.json", _summary(0.008, [("3/1/4", 1.6, 80, 0.0208)]), {"3/1/4": 2.6}, 16
    )
    a = _summary(0.010, [("3/1/4", 1.6, 80, 0.028), ("5/1/6", 2.0, 70, 0.030)])
    latest = _cal_file(tmp_path / "a/bench/calibration.json", a, {"3/1/4": 2.8, "5/1/6": 3.0}, 16)
    cfg = load_config(
        "configs/tiny.yaml", [f"bench.calibration={latest}", f"bench.calibration_pool=[{early1}, {early2}]"]
    )
    cal = from_config(cfg.bench)
    steps = (2.4 * 40 + 2.6 * 16 + 2.8 * 16) / 72
    row = cal["settings"]["3/1/4"]
    assert row["cycle_plain_steps"] == pytest.approx(steps) and row["cycle_s"] == pytest.approx(steps * 0.010)
    assert [p["prompts"] for p in row["pooled_from"]] == [16, 40, 16]
    assert cal["settings"]["5/1/6"]["cycle_plain_steps"] == 3.0  # only the latest ran it
    assert cal["settings"]["5/1/6"]["cycle_basis"] == "plain steps pooled over 1 run"
    r = {x["setting"]: x for x in predict(cal, {"3/1/4": 3.0, "5/1/6": 3.3})["rows"]}["3/1/4"]
    assert r["predicted_speedup"] == pytest.approx(3.0 / steps) and r["predicted_tok_s"] == pytest.approx(
        3.0 / (steps * 0.010)
    )
    assert r["cycle_basis"] == "measured, plain steps pooled over 3 runs"
    assert predict(cal, {"3/1/4": 3.0, "5/1/6": 3.3})["pick"]["setting"] in ("3/1/4", "5/1/6")  # both measured
    text = format_prediction(predict(cal, {"3/1/4": 3.0}))
    assert f"cycles in plain steps pooled with {early1}, {early2}" in text
    # with no pool, bench.calibration alone, as before
    alone = from_config(load_config("configs/tiny.yaml", [f"bench.calibration={latest}"]).bench)
    assert alone["settings"]["3/1/4"]["cycle_s"] == 0.028 and "pool" not in alone

    # through eval/economics/analysis.py: the prediction says which runs it pooled
    run_b = tmp_path / "b"
    (run_b / "eval").mkdir(parents=True)
    (run_b / "eval" / "accept_len.json").write_text(json.dumps({"settings": {"3/1/4": {"tau": 3.0}}}))
    pool = ["--set", f"bench.calibration={latest}", "--set", f"bench.calibration_pool=[{early1}, {early2}]"]
    main(["--config", "configs/tiny.yaml", "--run-dir", str(run_b), *pool])
    assert f"-> {3.0 / (steps * 0.010):.1f} tok/s" in capsys.readouterr().out
    assert json.loads((run_b / "bench" / "prediction.json").read_text())["calibration"]["pool"] == [
        str(early1),
        str(early2),
    ]


def _cal314(tmp_path, name: str, steps: float, backend="embedded", target="smol", summary=None):
    """A 16-prompt calibration of 3/1/4 alone at `steps` plain steps, in tmp_path/name."""
    s = summary or _summary(0.010, [("3/1/4", 1.6, 80, 0.028)], backend=backend)
    return _cal_file(tmp_path / name / "bench/calibration.json", s, {"3/1/4": steps}, 16, target)


def test_a_pool_of_another_backend_target_or_answer_length_is_refused_by_name(tmp_path, capsys):
    latest, sgl = _cal314(tmp_path, "a", 2.8), _cal314(tmp_path, "s", 2.8, backend="sglang")
    other = _cal314(tmp_path, "o", 2.8, target="k2")
    for bad, what in ((sgl, "backend 'sglang'"), (other, "target 'k2'")):
        cfg = load_config("configs/tiny.yaml", [f"bench.calibration={latest}", f"bench.calibration_pool=[{bad}]"])
        with pytest.raises(CalibrationError, match=f"{bad}: {what}, where bench.calibration {latest} has"):
            from_config(cfg.bench)
    with pytest.raises(CalibrationError, match="bench.calibration_pool needs bench.calibration"):
        from_config(load_config("configs/tiny.yaml", [f"bench.calibration_pool=[{latest}]"]).bench)
    run_b = tmp_path / "b"
    (run_b / "eval").mkdir(parents=True)
    (run_b / "eval" / "accept_len.json").write_text(json.dumps({"settings": {"3/1/4": {"tau": 3.0}}}))
    args = ["--config", "configs/tiny.yaml", "--run-dir", str(run_b), "--set", f"bench.calibration={latest}"]
    with pytest.raises(SystemExit):
        main([*args, "--set", f"bench.calibration_pool=[{tmp_path / 'nope.json'}]"])
    assert f"no calibration file {tmp_path / 'nope.json'} (bench.calibration_pool)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--set", f"bench.calibration_pool=[{sgl}]"])
    assert "backend 'sglang'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # the report reads the same pool, and says so in one line
        build.main([*args, "--set", f"bench.calibration_pool=[{sgl}]"])
    assert stop.value.code == 1 and "build.py: error: " in capsys.readouterr().err


def test_a_pooled_run_whose_servers_ran_other_args_is_named_in_the_predictions_warnings(tmp_path):
    def sgl(prefill: str | None, drafter: str) -> dict:
        s = _summary(0.010, [("3/1/4", 1.6, 80, 0.028)], backend="sglang")
        args = {"version": "0.5.17", "attention_backend": "triton", "mem_fraction_static": 0.1}
        s["environment"]["servers"] = {
            "baseline": {**args, "cuda_graph_backend_prefill": prefill},
            "3/1/4": {**args, "speculative_draft_model_path": drafter, "mem_fraction_static": 0.111},
        }
        return s

    latest = _cal314(tmp_path, "a", 2.8, summary=sgl("disabled", "/tmp/x/drafter"))
    same = _cal314(tmp_path, "s", 2.6, summary=sgl("disabled", "/tmp/y/drafter"))
    other = _cal314(tmp_path, "o", 2.4, summary=sgl(None, "/tmp/y/drafter"))
    old = _cal314(tmp_path, "n", 2.6, backend="sglang")  # a file from before `servers`: nothing to compare
    cfg = load_config(
        "configs/tiny.yaml", [f"bench.calibration={latest}", f"bench.calibration_pool=[{same}, {other}, {old}]"]
    )
    cal = from_config(cfg.bench)
    # the drafter's path and each server's memory share are per run; the prefill graphs are a cost
    assert cal["pool_warnings"] == [
        f"{other}: its baseline server differs from bench.calibration's in cuda_graph_backend_prefill"
    ]
    pred = predict(cal, {"3/1/4": 3.0})
    assert pred["warnings"] == cal["pool_warnings"]
    b = _summary(0.010, [("3/1/4", 2.9, 140.0, 0.021)], backend="sglang")
    j = join(pred, b, target="smol")
    assert j["warnings"][0] == cal["pool_warnings"][0]
    assert f"warning: {other}: its baseline server differs" in format_prediction(j)


def test_the_pick_is_made_on_the_loop_free_tau():
    """A deep tree that wins on loops (live tau 4.1 against 2.6) but loses outside them is not picked: the loop-free
    tau ranks the settings, and the live one only when there is no split."""
    summary = {
        "baseline": {"tok_s_median": 100.0, "ms_per_token": 10.0},
        "costs": {"baseline_s_per_token": 0.01, "verify_s": {"4": 0.02, "32": 0.03}, "draft_forward_s": 0.0,
                  "overhead_s": 0.0},
        "speculative": [
            {"setting": {"steps": 3, "topk": 1, "num_draft_tokens": 4}, "tau": 2.6, "tok_s_median": 130.0,
             "cycle_s": 0.02, "figures": {"loop_free": {"tau": 2.4}}},
            {"setting": {"steps": 8, "topk": 4, "num_draft_tokens": 32}, "tau": 4.1, "tok_s_median": 136.0,
             "cycle_s": 0.03, "figures": {"loop_free": {"tau": 2.5}}},
        ],
    }  # fmt: skip
    ec = analyse(summary)
    assert ec.best_basis == "loop_free" and ec.best_setting == "3/1/4"  # 2.4/0.02 = 120 against 2.5/0.03 = 83
    assert analyse(summary, offline_loop_free={}).settings[1].predicted_tok_s_loop_free_tau == pytest.approx(2.5 / 0.03)
    for row in summary["speculative"]:
        row.pop("figures")
    assert analyse(summary).best_basis == "live" and analyse(summary).best_setting == "8/4/32"
    assert analyse(summary, offline_loop_free={"8/4/32": 3.5}).best_setting == "8/4/32"
