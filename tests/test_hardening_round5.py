"""Hardening, round five: a resume never pairs weights with another dataset's vocabulary, nothing of the user's is
deleted or written through, and the read-side stages check their run folder before they record anything."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from train_fixtures import REPO, launch, write_store

TINY = REPO / "configs/tiny.yaml"
STEPS = ("train.max_steps=2", "train.save_every=1", "train.ttt_steps=2", "train.warmup_steps=1")


def error_lines(r) -> list[str]:
    return [line for line in (r.stdout + r.stderr).splitlines() if re.search("error|traceback", line, re.I)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 steps of one process on a store of 8 training samples, a checkpoint at each."""
    run = tmp_path_factory.mktemp("trained")
    write_store(run, n_train=8, n_heldout=2)
    r = launch(run, *STEPS, procs=1)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.mark.slow
def test_a_resume_after_a_reharvest_of_as_many_samples_is_refused_in_one_line(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    shutil.rmtree(run / "features")
    (run / "vocab.safetensors").unlink()
    write_store(run, n_train=8, n_heldout=2, seed=1)  # other prompts, the same sample count
    export = (run / "export" / "model.safetensors").read_bytes()
    r = launch(run, *STEPS, "train.max_steps=4", procs=1, extra=("--resume", "auto"))
    assert r.returncode != 0
    errors = error_lines(r)
    assert len(errors) == 1, errors
    assert re.match(
        rf"finetune: error: {re.escape(str(run / 'ckpt' / 'step-2'))}: written for other data than this run now has "
        r"\(\d+ of 512 draft ids of its d2t map to other target tokens .*; the training shards of .* are not those",
        errors[0],
    ), errors
    assert (run / "export" / "model.safetensors").read_bytes() == export
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["step-1", "step-2"]


@pytest.mark.slow
def test_a_checkpoint_records_the_identity_of_its_data_and_vocab(trained):
    from eagle3ft.train.checkpoint import read_trainer_state

    identity = read_trainer_state(trained / "ckpt" / "step-2")["data_identity"]
    assert set(identity) == {"train_shards", "d2t_sha256"} and all(
        re.fullmatch("[0-9a-f]{64}", v) for v in identity.values()
    )


# --------------------------------------------------------------------------- the user's export/ and links (in-process)


def tree(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def finetune_cli(run_dir: Path, *extra: str) -> None:
    import eagle3ft.train.finetune as finetune

    finetune.main(["--config", str(TINY), "--run-dir", str(run_dir), "--set", "train.wandb_mode=disabled", *extra])


@pytest.fixture
def stand_in(monkeypatch):
    """train/loop.py's run_training replaced by one that passes every check at once: on_start runs, nothing trains."""
    import eagle3ft.train.finetune as finetune

    calls: list = []

    def run_training(cfg, run_dir, on_start=None):
        calls.append(run_dir)
        if on_start is not None:
            on_start(None)
        return {}

    monkeypatch.setattr(finetune, "run_training", run_training)
    return calls


@pytest.mark.parametrize("name", ["export", "export-best"])
@pytest.mark.parametrize("mode", [(), ("--resume", "auto"), ("--overwrite",)])
def test_training_refuses_to_replace_a_drafter_the_user_put_in_export(tmp_path, stand_in, capsys, name, mode):
    run = tmp_path / "run"
    write_store(run, n_train=2, n_heldout=1)
    (run / name).mkdir()
    (run / name / "model.safetensors").write_bytes(b"the user's drafter")
    (run / name / "config.json").write_text("{}")
    before = tree(run)
    with pytest.raises(SystemExit) as e:
        finetune_cli(run, *mode)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0] == (
        f"finetune.py: error: {run / name} is not an export this trainer wrote (no card.json of it), and training "
        "writes its drafter there: move it elsewhere first (--overwrite removes only the trainer's outputs, not this)"
    )
    assert tree(run) == before and stand_in == []


def test_a_link_at_metrics_jsonl_is_refused_and_its_target_untouched(tmp_path, stand_in, capsys):
    run = tmp_path / "run"
    write_store(run, n_train=2, n_heldout=1)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's\n")
    (run / "train").mkdir()
    (run / "train" / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(SystemExit) as e:
        finetune_cli(run, "--resume", "auto")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"finetune.py: error: {run / 'train' / 'metrics.jsonl'} is a link (to {outside})")
    assert outside.read_text() == "not the run's\n" and stand_in == []


def test_metrics_are_never_written_through_a_link(tmp_path):
    from eagle3ft.train.checkpoint import truncate_metrics
    from eagle3ft.train.metrics import log_record

    metrics = tmp_path / "train" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's\n")
    (metrics.parent / ".metrics.jsonl.tmp").symlink_to(outside)  # a resume from step 2 rewrites through the .tmp
    assert truncate_metrics(metrics, 2) == 1
    assert outside.read_text() == "not the run's\n"
    assert metrics.read_text() == '{"step": 1}\n{"step": 2}\n' and not metrics.is_symlink()
    metrics.unlink()
    metrics.symlink_to(outside)
    with pytest.raises(OSError):
        log_record({"step": 3, "loss": 1.0, "acc": [0.5], "tokens_per_s": 1.0}, metrics, None, _Bar())
    assert outside.read_text() == "not the run's\n"


class _Bar:
    def set_postfix(self, **kw) -> None:
        pass
