"""Hardening, round five: a resume never pairs weights with another dataset's vocabulary, nothing of the user's is
deleted or written through, and the read-side stages check their run folder before they record anything."""

from __future__ import annotations

import re
import shutil

import pytest
from train_fixtures import launch, write_store

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
