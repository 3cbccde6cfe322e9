"""A DFlash drafter through the real entry points on configs/tiny.yaml: harvest -> train (cut short, resumed: the same
losses as an unbroken run) -> offline τ, which equals the held-out τ training logged at its last step -> the embedded bench -> the report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from train_fixtures import REPO, launch

DFLASH = ["--set", "drafter.config=configs/drafters/tiny-dflash.json"]
TRAIN = ["train.max_steps=6", "train.save_every=3", "train.objective.dflash_num_anchors=16"]


def _run(args: list[str], run_dir) -> str:
    p = subprocess.run(
        [sys.executable, *args, "--config", "configs/tiny.yaml", "--run-dir", str(run_dir), *DFLASH],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, f"{args} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def _train(run_dir, *extra: str) -> None:
    p = launch(run_dir, "drafter.config=configs/drafters/tiny-dflash.json", *TRAIN, *extra, extra=("--resume", "auto"))
    assert p.returncode == 0, p.stderr[-3000:]


def _losses(run_dir) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_dflash_pipeline(tmp_path):
    run, unbroken = tmp_path / "run", tmp_path / "unbroken"
    _run(["data/harvest.py"], run)
    manifest = json.loads((run / "features" / "manifest.json").read_text())
    assert manifest["target"]["capture"]["kind"] == "dflash" and manifest["counts"]["heldout"]["samples"] > 0
    (unbroken / "features").parent.mkdir(parents=True)
    subprocess.run(["cp", "-r", str(run / "features"), str(unbroken / "features")], check=True)

    _train(run, "train.stop_after=3")
    assert (run / "ckpt" / "step-3").is_dir() and not (run / "export").exists()
    _train(run)
    _train(unbroken)
    assert _losses(run) == pytest.approx(_losses(unbroken), rel=1e-5)  # the resumed run drew the same anchors
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    card = json.loads((run / "export" / "card.json").read_text())

    out = _run(["eval/offline/accept_len.py"], run)
    acc = json.loads((run / "eval" / "accept_len.json").read_text())
    assert "DFlash chain walk" in out and acc["kind"] == "dflash" and acc["roots"] > 0
    assert acc["headline_tau"] == pytest.approx(card["heldout_tau"])  # training's held-out τ is the same walk
    assert acc["spec_accept_length"] == pytest.approx(card["heldout_spec_accept_length"])
    assert 1.0 <= acc["headline_tau"] <= acc["block_size"]
    _run(["train/validate.py"], run)  # the standalone held-out τ is training's too
    assert json.loads((run / "eval" / "heldout_tau.json").read_text())["heldout_tau"] == pytest.approx(
        acc["headline_tau"]
    )
    bench = ["--set", "bench.settings=[{steps: 3, topk: 1, num_draft_tokens: 4}]", "--set", "bench.max_new_tokens=8"]
    _run(["eval/bench/live.py", *bench, "--set", "bench.repetitions=1"], run)
    summary = json.loads((run / "bench" / "summary.json").read_text())
    assert summary["speculative"][0]["outputs_match_baseline"] == 1.0  # the block decoder is lossless
    assert summary["costs"]["block"] is True  # priced as one draft forward a cycle
    _run(["eval/report/build.py"], run)
    assert "DFlash chain walk" in (run / "eval" / "report.md").read_text()
