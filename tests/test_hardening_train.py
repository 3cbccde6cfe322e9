"""Training as an operator and an attacker would run it: --overwrite removes only what the trainer wrote, and only in
a run folder; a refused start changes nothing; a resume runs this config's rates; checkpoints carry checksums;
refusals are one line under any launcher; a diverging loss is named."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from train_fixtures import REPO, write_store

import eagle3ft.train.finetune as finetune
from eagle3ft.train.checkpoint import FORMAT

TINY = REPO / "configs/tiny.yaml"


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def started_main(calls: list):
    """A stand-in for train/loop.py's main that passes every check at once: on_start runs, nothing trains."""

    def main(cfg, run_dir, on_start=None):
        calls.append(run_dir)
        if on_start is not None:
            on_start(None)
        return {}

    return main


def finetune_cli(run_dir: Path, *extra: str) -> None:
    finetune.cli(["--config", str(TINY), "--run-dir", str(run_dir), "--set", "train.wandb_mode=disabled", *extra])


def test_overwrite_refuses_a_folder_that_is_no_run_and_removes_nothing(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(finetune, "main", started_main(calls))
    checkout = tmp_path / "checkout"  # what a checkout looks like: the train/ package, a user's export/
    for name, text in {
        "pyproject.toml": "[project]\n",
        "train/__init__.py": "",
        "train/loop.py": "x = 1\n",
        "train/metrics.py": "y = 2\n",
        "export/notes.txt": "mine\n",
        "export/card.json": '{"which": "last"}',
    }.items():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text(text)
    before = tree(checkout)
    with pytest.raises(SystemExit) as e:
        finetune_cli(checkout, "--overwrite")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0] == (
        f"finetune.py: error: --overwrite: {checkout} is not a run folder (no config.yaml of a stage, no "
        "features/manifest.json, no ckpt/step-N of the trainer), so nothing in it is removed; give the folder a "
        "harvest wrote to"
    )
    assert "training run" not in err[0] and "with --overwrite" not in err[0]
    assert tree(checkout) == before and calls == []

    finetune_cli(checkout)  # without --overwrite: no refusal that calls it a training run; the loop names what lacks
    assert calls == [checkout] and "already holds" not in capsys.readouterr().err
    assert {k: v for k, v in tree(checkout).items() if k != "config.yaml"} == before


def test_overwrite_removes_only_what_the_trainer_wrote(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(finetune, "main", started_main(calls))
    run = tmp_path / "run"
    write_store(run, n_train=2, n_heldout=1)
    trainer = {
        "ckpt/step-2/trainer_state.json": json.dumps({"format": FORMAT, "step": 2}),
        "ckpt/step-2/model.safetensors": "w",
        "ckpt/.step-4.tmp/config.json": "{}",
        "export/card.json": json.dumps({"which": "last", "step": 2}),
        "export/model.safetensors": "w",
        "export-best/card.json": json.dumps({"which": "best", "step": 2}),
        ".export.old/model.safetensors": "w",
        "train/metrics.jsonl": '{"step": 1}\n',
        "train/data.json": "{}",
        "train/wandb/run.log": "",
    }
    users = {
        "ckpt/README": "my notes on these checkpoints\n",
        "ckpt/step-9/weights.bin": "not the trainer's: no trainer_state.json",
        "train/notes.txt": "mine\n",
        "train/__init__.py": "",
        "export-sglang/card.json": json.dumps({"which": "last"}),
    }
    for name, text in {**trainer, **users}.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    with pytest.raises(SystemExit) as e:
        finetune_cli(run)
    assert e.value.code == 2 and calls == []
    listed = "ckpt/step-2, ckpt/.step-4.tmp, export, .export.old, export-best, train/metrics.jsonl, train/data.json, "
    listed += "train/wandb"
    assert capsys.readouterr().err.strip() == (
        f"finetune.py: error: {run} already holds a training run ({listed}); continue it with --resume auto, or start "
        "over in a new --run-dir or with --overwrite (removes those first)"
    )
    finetune_cli(run, "--overwrite")
    assert f"--overwrite: removed {listed} of {run}" in capsys.readouterr().err
    left = {k for k, v in tree(run).items() if v is not None}
    assert {k for k in users} <= left and not {k for k in trainer} & left
    assert (run / "features" / "manifest.json").is_file() and (run / "vocab.safetensors").is_file()
    assert "train" in yaml.safe_load((run / "config.yaml").read_text())["stages"]


# --------------------------------------------------------------------------- checkpoints carry checksums


class SavingDist:
    """What save_checkpoint asks of train/dist.py's Dist, on one process: whole tensors at once."""

    is_main = True

    def training_state(self):
        return {"fp32.w": torch.arange(4096, dtype=torch.float32)}, {"optimizer": {"step": 1}}

    def full_state_dict(self, module):
        return {f"drafter.{k}": v for k, v in module.state_dict().items()}

    def barrier(self) -> None:
        pass


def tiny_drafter():
    from eagle3ft.drafter.config import DrafterConfig
    from eagle3ft.drafter.model import Eagle3Drafter

    torch.manual_seed(0)
    return Eagle3Drafter(DrafterConfig.from_json(REPO / "configs/drafters/tiny.json"))


def save_steps(run: Path, *steps: int) -> None:
    from eagle3ft.train.checkpoint import save_checkpoint

    model = tiny_drafter()
    for step in steps:
        save_checkpoint(SavingDist(), model, model.config, run, step, {"step": step, "last": {"loss": 1.0}}, keep=0)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # inside the tensor data: the header still parses
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damaged", ["state.safetensors", "model.safetensors", "state.json"])
def test_resume_auto_passes_over_a_checkpoint_whose_file_fails_its_checksum(tmp_path, damaged):
    from eagle3ft.train.checkpoint import CheckpointError, choose_resume, verify_checkpoint

    save_steps(tmp_path, 2, 4)
    newest = tmp_path / "ckpt" / "step-4"
    assert set(json.loads((newest / "trainer_state.json").read_text())["sha256"]) == {
        "config.json",
        "model.safetensors",
        "state.json",
        "state.safetensors",
    }
    if damaged == "state.json":
        (newest / damaged).write_text((newest / damaged).read_text().replace('"step": 1', '"step": 7'))
    else:
        flip_a_byte(newest / damaged)
    why = f"{newest / damaged}: fails its sha256 check (damaged after it was written)"
    assert choose_resume(tmp_path, "auto") == (tmp_path / "ckpt" / "step-2", [why])
    with pytest.raises(CheckpointError, match=re.escape(why)):
        verify_checkpoint(newest)  # a named --resume loads through it too (load_checkpoint)
