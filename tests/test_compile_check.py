"""benchmarks/compile_check.py on the CPU: bf16 eager and compiled (train.compile) against a float64 reference."""

import importlib.util
import json
from pathlib import Path

import pytest

from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.model import Eagle3Drafter

REPO = Path(__file__).resolve().parent.parent


def load_compile_check():
    spec = importlib.util.spec_from_file_location("compile_check", REPO / "benchmarks" / "compile_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_bf16_compiled_step_is_as_close_to_fp64_as_eager(tmp_path):
    """Every per-step forward tensor, the loss and every gradient: compiled no further from float64 than eager
    (it rounds fewer intermediates to bf16), and two training steps follow the same losses."""
    cc = load_compile_check()
    out = tmp_path / "r.json"
    report = cc.main(
        [
            "--dims",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "bf16",
            "--seq",
            "24",
            "--ttt",
            "3",
            "--train-steps",
            "2",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["verdict"] == report["verdict"]
    rows = {r["tensor"]: r for r in report["rows"]}
    drafter = Eagle3Drafter(DrafterConfig.from_json(REPO / "configs/drafters/tiny.json"))
    assert {f"grad.{n}" for n, p in drafter.named_parameters() if p.requires_grad} == {
        n for n in rows if n.startswith("grad.")
    }
    assert [f"step{k}.{t}" for k in range(3) for t in cc.STEP_TENSORS] == [
        n for n in rows if n.startswith("step") and "." in n
    ]
    assert report["first_worse"] is None, report["verdict"]
    for r in report["rows"]:
        assert 0 < r["eager_vs_ref"] < 3e-2 and r["compiled_vs_ref"] < 3e-2, (
            r
        )  # bf16 rounding, not zero: the reference is fp64
    assert rows["loss"]["compiled_vs_eager"] < 1e-3
    traj = report["trajectory"]
    assert len(traj["eager"]) == len(traj["compiled"]) == len(traj["reference"]) == 2
    for a, b in zip(traj["compiled"], traj["reference"]):
        assert abs(a - b) < 1e-2 * abs(b)
