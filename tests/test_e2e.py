"""The whole pipeline through its real entry points on configs/tiny.yaml: harvest -> train
(interrupted, then resumed) -> offline accept length -> live benchmark -> report."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/tiny.yaml"
TRAIN = [
    "--set",
    "train.schedule.max_steps=8",
    "--set",
    "train.checkpoint.save_every=4",
    "--set",
    "train.logging.wandb_mode=disabled",
    "--set",
    "train.objective.ttt_steps=3",
]
BENCH = ["--set", "bench.max_new_tokens=8", "--set", "bench.repetitions=3"]


def _run(args: list[str], run_dir: Path) -> str:
    p = subprocess.run(
        args + ["--config", CONFIG, "--run-dir", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, f"{' '.join(args)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def _train(run_dir: Path, *extra: str) -> str:
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "configs/accelerate/cpu-2proc.yaml",
        "train/finetune.py",
    ]
    return _run(launch + ["--resume", "auto", *TRAIN, *extra], run_dir)


@pytest.mark.slow
def test_pipeline_end_to_end(tmp_path):
    run = tmp_path / "run"
    _run([sys.executable, "data/harvest.py"], run)
    manifest = json.loads((run / "features" / "manifest.json").read_text())
    assert manifest["counts"]["heldout"]["samples"] > 0

    _train(run, "--set", "train.schedule.stop_after=4")  # a job cut short after 4 of 8 steps
    assert (run / "ckpt" / "step-4").is_dir() and not (run / "export").exists()
    _train(run)
    steps = [json.loads(x)["step"] for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    assert (run / "export" / "model.safetensors").is_file()

    out = _run([sys.executable, "eval/offline/accept_len.py"], run)
    acc = json.loads((run / "eval" / "accept_len.json").read_text())
    assert "tau =" in out and acc["roots"] > 0 and 1.0 <= acc["headline_tau"] <= acc["steps"] + 1

    _run([sys.executable, "eval/bench/live.py", *BENCH], run)
    summary = json.loads((run / "bench" / "summary.json").read_text())
    rows = (run / "bench" / "runs.jsonl").read_text().splitlines()
    assert len(rows) == 3 * 2 * summary["prompts"]["count"]
    assert summary["speculative"][0]["outputs_match_baseline"] == 1.0

    out = _run([sys.executable, "eval/report/build.py"], run)
    rep = json.loads((run / "eval" / "report.json").read_text())
    h = rep["headline"]
    assert h["tau_offline"] == acc["headline_tau"] and h["tau_live"] == summary["speculative"][0]["tau"]
    assert f"tau offline {h['tau_offline']:.2f}" in out and "break-even tau" in out
    assert set(rep["plots"]) == {"train_loss", "accept_per_depth", "tau_offline_vs_live", "tok_s_vs_draft_tokens"}
