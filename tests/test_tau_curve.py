"""benchmarks/tau_curve.py: the fit against synthetic numbers, and a run folder read for its tokens and τ."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from train_fixtures import write_store

from eagle3ft.data.store import FeatureStore

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("tau_curve", ROOT / "benchmarks/tau_curve.py")
tau_curve = sys.modules["tau_curve"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(tau_curve)


def test_fit_recovers_a_log_law_and_prices_the_next_gain(tmp_path):
    """τ = 1.2 + 0.1·ln(tokens) (3/1/4) and 1.0 + 0.05·ln(tokens) (1/1/2): b is the slope, +0.2 τ takes e^(0.2/b) the
    data."""
    pts = [
        {"run": f"r{i}", "tokens": t, "set": "mtbench", "setting": s, "tau": a + b * math.log(t)}
        for i, t in enumerate([7e5, 2e6, 5e6, 1e7])
        for s, a, b in (("3/1/4", 1.2, 0.1), ("1/1/2", 1.0, 0.05))
    ]
    pts.append(
        {"run": "r0", "tokens": 7e5, "set": "humaneval", "setting": "3/1/4", "tau": 2.0}
    )  # one size: no prediction
    (tmp_path / "points.json").write_text(json.dumps(pts))
    res = tau_curve.main(["--points", str(tmp_path / "points.json"), "--out", str(tmp_path / "out")])
    fits = {(f["set"], f["setting"]): f for f in res["fits"]}
    f = fits[("mtbench", "3/1/4")]
    assert f["b"] == pytest.approx(0.1) and f["a"] == pytest.approx(1.2) and f["r2"] == pytest.approx(1.0)
    assert f["data_factor"] == pytest.approx(math.exp(2.0)) and f["tokens_for_gain"] == pytest.approx(
        1e7 * math.exp(2.0)
    )
    assert f["tau_at_max"] == pytest.approx(1.2 + 0.1 * math.log(1e7))
    assert fits[("mtbench", "1/1/2")]["data_factor"] == pytest.approx(math.exp(4.0))
    assert fits[("humaneval", "3/1/4")]["data_factor"] is None and fits[("humaneval", "3/1/4")]["n"] == 1
    assert [k[1] for k in fits if k[0] == "mtbench"] == ["1/1/2", "3/1/4"]  # settings in numeric order
    assert (tmp_path / "out" / "tau_curve.png").stat().st_size > 1000
    assert json.loads((tmp_path / "out" / "tau_curve.json").read_text())["gain"] == 0.2


def test_a_run_folder_gives_its_train_answer_tokens_and_each_sets_tau(tmp_path):
    write_store(tmp_path, n_train=6, n_heldout=2)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "accept_len.json").write_text(
        json.dumps({"settings": {"1/1/2": {"tau": 1.4}, "3/1/4": {"tau": 1.7}}})
    )
    (tmp_path / "eval" / "accept_len-humaneval.json").write_text(json.dumps({"settings": {"3/1/4": {"tau": 1.9}}}))
    want = sum(int(it["loss_mask"].sum()) for it in FeatureStore(tmp_path / "features").dataset("train"))
    pts = tau_curve.run_points(tmp_path)
    assert {(p.set, p.setting, p.tau) for p in pts} == {
        ("heldout", "1/1/2", 1.4),
        ("heldout", "3/1/4", 1.7),
        ("humaneval", "3/1/4", 1.9),
    }
    assert all(p.tokens == want for p in pts) and want > 0
    with pytest.raises(FileNotFoundError, match="accept_len"):
        tau_curve.run_points(tmp_path / "features")
    (tmp_path / "train").mkdir()  # a run that recorded its (subset's) answer tokens: that is the x
    (tmp_path / "train" / "data.json").write_text(json.dumps({"answer_tokens": 1234, "epochs": 3}))
    assert {(p.tokens, p.epochs) for p in tau_curve.run_points(tmp_path)} == {(1234, 3)}
