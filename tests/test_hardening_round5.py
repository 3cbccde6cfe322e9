"""Hardening, round five: a resume never pairs weights with another dataset's vocabulary, nothing of the user's is
deleted or written through, and the read-side stages check their run folder before they record anything."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from train_fixtures import REPO, launch, write_store

TINY = REPO / "configs/tiny.yaml"
STEPS = (
    "train.schedule.max_steps=2",
    "train.checkpoint.save_every=1",
    "train.objective.ttt_steps=2",
    "train.schedule.warmup_steps=1",
)


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
    r = launch(run, *STEPS, "train.schedule.max_steps=4", procs=1, extra=("--resume", "auto"))
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
def test_a_resume_that_would_change_the_loss_is_refused_and_the_keys_it_applies_are_named(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    ckpt = run / "ckpt" / "step-2"
    r = launch(
        run, *STEPS, "train.schedule.max_steps=3", "train.objective.loss=tv", procs=1, extra=("--resume", "auto")
    )
    assert r.returncode != 0
    errors = error_lines(r)
    assert len(errors) == 1 and errors[0].startswith(
        f"finetune: error: {ckpt}: this config's train.objective.loss 'tv' (it ran 'ce') would change what the loss is"
    ), errors
    changes = (
        "train.schedule.max_steps=3",
        "train.objective.l2sp=0.01",
        "train.optimizer.max_grad_norm=1.0",
        "train.objective.step_decay=0.5",
    )
    r = launch(run, *STEPS, *changes, procs=1, extra=("--resume", "auto"))
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("resume: this config's"))
    for named in (
        "train.schedule.max_steps 3 (the checkpoint ran 2)",
        "train.optimizer.max_grad_norm 1.0 (the checkpoint ran 0.5)",
        "train.objective.l2sp 0.01 (the checkpoint ran 0.0)",
        "train.objective.step_decay 0.5 (the checkpoint ran 0.8)",
    ):
        assert named in line, line


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

    finetune.main(
        ["--config", str(TINY), "--run-dir", str(run_dir), "--set", "train.logging.wandb_mode=disabled", *extra]
    )


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


# --------------------------------------------------------------------------- the read-side stages' --run-dir


def read_side_mains():
    from eagle3ft.eval.bench import live
    from eagle3ft.eval.economics import analysis
    from eagle3ft.eval.offline import accept_len, compare
    from eagle3ft.eval.report import build

    return {
        "eval": accept_len.main,
        "bench": live.main,
        "economics": analysis.main,
        "report": build.main,
        "compare": compare.main,
    }


STAGES = ("eval", "bench", "economics", "report", "compare")


def stop(stage: str, run_dir: Path, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        read_side_mains()[stage](["--config", str(TINY), "--run-dir", str(run_dir)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("stage", STAGES)
def test_a_read_side_stage_refuses_a_run_dir_that_is_a_file(tmp_path, capsys, stage):
    mistyped = tmp_path / "notes.txt"
    mistyped.write_text("mine\n")
    assert stop(stage, mistyped, capsys).endswith(f"error: --run-dir {mistyped} is a file, not a run folder")
    assert mistyped.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize(
    "text,why",
    [
        ("- a\n- list\n", "not a run's record (a mapping with `stages`"),
        ("# my settings\nseed: 3\n", "not a run's record (a mapping with `stages`"),
        ("seed: [3\n", "not a run's record, unreadable"),
    ],
    ids=["list", "mapping", "unparsable"],
)
def test_a_read_side_stage_never_rewrites_a_config_yaml_that_is_no_runs_record(tmp_path, capsys, stage, text, why):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.yaml").write_text(text)
    (folder / "export").mkdir()
    assert f"error: {folder / 'config.yaml'}: {why}" in stop(stage, folder, capsys)
    assert (folder / "config.yaml").read_text() == text
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml", "export"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_read_side_stage_creates_no_folder_and_writes_none_that_is_no_run(tmp_path, capsys, stage):
    missing = tmp_path / "typo"
    assert f"error: no run folder {missing}: {stage} reads what earlier stages wrote there" in stop(
        stage, missing, capsys
    )
    assert not missing.exists()
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine\n")
    assert f"error: {home} is not a run folder" in stop(stage, home, capsys)
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt"]


def test_training_refuses_a_run_dir_that_is_a_file_in_one_line(tmp_path, capsys):
    mistyped = tmp_path / "notes.txt"
    mistyped.write_text("mine\n")
    with pytest.raises(SystemExit) as e:
        finetune_cli(mistyped)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"finetune.py: error: --run-dir {mistyped} is a file, not a run folder"]


# --------------------------------------------------------------------------- compare


@pytest.fixture
def compare_run(tmp_path):
    from test_eval_compare import X, Y, constant_drafter, write_heldout

    run = tmp_path / "run"
    write_heldout(run)
    constant_drafter(run / "drafts-x", X)
    constant_drafter(run / "drafts-y", Y)
    (run / "bench").mkdir()
    return run


def compare_stop(run: Path, capsys, before: Path, after: Path) -> str:
    from eagle3ft.eval.offline import compare

    with pytest.raises(SystemExit) as e:
        compare.main(["--config", str(TINY), "--run-dir", str(run), "--before", str(before), "--after", str(after)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    "name,text",
    [
        ("economics.json", '{"settings": [{"setting": "3/1/4", "break_e'),
        ("economics.json", "[1, 2]"),
        (
            "summary.json",
            '{"prompt_sets": {"code": {"baseline": {}, "drafters": {"a": {"speculative": [{"key": "3/1/4", '
            '"cycle_s": 0.1}]}}}}}',
        ),
        ("summary.json", '{"prompt_sets": {"code": {"bas'),
    ],
    ids=["truncated-economics", "list-economics", "no-baseline-summary", "truncated-summary"],
)
def test_compare_names_a_damaged_cost_file_before_it_measures_anything(compare_run, capsys, monkeypatch, name, text):
    from eagle3ft.eval.offline import compare

    def measured(*a, **k):
        raise AssertionError("both drafters were measured before the cost files were read")

    monkeypatch.setattr(compare, "drafter_walks", measured)
    (compare_run / "bench" / name).write_text(text)
    line = compare_stop(compare_run, capsys, compare_run / "drafts-x", compare_run / "drafts-y")
    assert line.startswith(f"compare.py: error: {compare_run / 'bench' / name}: "), line


def test_compare_gives_one_conversation_no_interval_and_no_verdict_of_certainty():
    from eagle3ft.eval.offline import compare

    c = compare.change(compare.SetTotals([(10, 10, 10, 10)]), compare.SetTotals([(10, 5, 10, 5)]))
    assert c["tau"]["interval"] is None and c["tau_loop_free"]["interval"] is None
    assert compare.verdict_line({"s": c}) == (
        "verdict: no clear change s +1.00 τ (+100.0% [no interval: one conversation])"
    )


def test_compare_refuses_a_training_checkpoint_as_drafter_weights(compare_run, capsys, tmp_path):
    ckpt = compare_run / "ckpt" / "step-2"
    shutil.copytree(compare_run / "drafts-y", ckpt)
    (ckpt / "state.safetensors").write_bytes(b"optimizer state")
    (ckpt / "trainer_state.json").write_text('{"step": 2}')
    line = compare_stop(compare_run, capsys, compare_run / "drafts-x", ckpt)
    assert line.startswith(f"compare.py: error: --after {ckpt} is a training checkpoint"), line


def test_compare_on_a_full_disk_is_one_line_naming_its_result(compare_run, capsys, monkeypatch):
    import errno

    from eagle3ft.eval.offline import compare

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(compare, "write_json", full)
    line = compare_stop(compare_run, capsys, compare_run / "drafts-x", compare_run / "drafts-y")
    assert line.startswith(f"compare.py: error: {compare_run / 'eval' / 'compare.json'}: no space left"), line


# --------------------------------------------------------------------------- a full disk


def test_safetensors_08s_real_disk_full_error_is_a_disk_full_naming_the_file(tmp_path):
    from safetensors import SafetensorError

    from eagle3ft.files import DiskFull, disk_full

    # safetensors 0.8.0's save_file on a full tmpfs raises exactly this (no errno on the exception)
    real = "Error while serializing: I/O error: No space left on device (os error 28)"
    with pytest.raises(DiskFull, match=rf"^{re.escape(str(tmp_path / 'w.safetensors'))}: no space left"):
        with disk_full(tmp_path / "w.safetensors"):
            raise SafetensorError(real)
    with pytest.raises(SafetensorError):  # another I/O error stays itself
        with disk_full(tmp_path / "w.safetensors"):
            raise SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)")


def test_a_full_disk_at_the_run_lock_is_one_line_and_leaves_no_empty_lock(tmp_path, capsys, monkeypatch):
    import errno
    import os

    from eagle3ft.runlock import holding

    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fd):
            self.f = real_fdopen(fd, "w")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda fd, mode="r", *a, **k: Full(fd))
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(SystemExit) as e:
        with holding(run, "eval", "accept_len.py"):
            raise AssertionError("the lock was taken on a full disk")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and err[0].startswith(f"accept_len.py: error: {run / '.lock'}: no space")
    assert list(run.iterdir()) == []


# --------------------------------------------------------------------------- bounds at config time


@pytest.mark.parametrize(
    "override,key",
    [
        ("train.objective.l2sp=1e30", "l2sp"),
        ("train.objective.l2sp=1e39", "l2sp"),
        ("harvest.sources=[{kind: sharegpt, weight: 1e300}]", "weight"),
    ],
)
def test_a_weight_that_cannot_train_is_refused_when_the_config_loads(override, key):
    from eagle3ft.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"{key}.*<= "):
        load_config(TINY, [override])
    load_config(TINY, ["train.objective.l2sp=1e4", "harvest.sources=[{kind: sharegpt, weight: 100}]"])


def test_a_changed_source_weight_is_refused_with_the_right_counts(tmp_path):
    from types import SimpleNamespace

    from eagle3ft.train.checkpoint import CheckpointError, resume_position
    from eagle3ft.train.run_state import order_entries

    class Data(SimpleNamespace):
        def __len__(self) -> int:
            return 12

    data = Data(weights=[2.0] * 12, lengths=None)
    st = {"data": {"epoch": 0, "samples_in_epoch": 4, "n_train": 12}}  # written at weight 1: 12 draws
    with pytest.raises(CheckpointError) as e:
        resume_position(st, tmp_path, 24, 1, 1, order_entries(data))  # weight 2 now: 24 draws of the 12 samples
    assert str(e.value) == (
        f"{tmp_path / 'trainer_state.json'}: written for an epoch of 12 entries, this run's has 24 (draws of its 12 "
        "training samples by harvest.sources' weights); resume with the checkpoint's store and settings, or start "
        "over with --overwrite"
    )
    assert "the store has" not in str(e.value)


# --------------------------------------------------------------------------- exclude_heldout and split: auto


def test_exclude_heldout_drops_what_shares_an_8gram_with_a_conversation_split_auto_holds_out(tmp_path):
    import json

    from eagle3ft.config import load_config
    from eagle3ft.data.harvest import conversations

    texts = [" ".join(f"w{i}x{j}" for j in range(10)) for i in range(12)]  # no 8-gram shared between two
    auto = tmp_path / "auto.jsonl"
    auto.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in texts))
    replay = tmp_path / "replay.jsonl"
    replay.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"Quoted: {t}"}]}) + "\n" for t in texts)
    )
    cfg = load_config(
        TINY,
        [
            f"harvest.sources=[{{kind: file, path: {auto}, exclude_heldout: true}}, "
            f"{{kind: file, path: {replay}, split: train, exclude_heldout: true}}]",
            "harvest.heldout_fraction=0.5",
        ],
    )
    convs, skips = conversations(cfg.harvest, lambda m: None, True)
    split = {c.messages[0]["content"]: c.split for c in convs}
    held = {t for t in texts if split.get(t) == "heldout"}
    assert 0 < len(held) < len(texts) and all(t in split for t in texts)  # none of its own dropped
    replayed = {t for t in texts if f"Quoted: {t}" in split}
    assert replayed == set(texts) - held and skips["heldout_ngram"] == len(held)


# --------------------------------------------------------------------------- one line for each wrong input


@pytest.mark.parametrize("rate", ["nan", "inf", "-5", "0", "fast"])
def test_economics_refuses_a_decode_rate_that_is_no_rate(tmp_path, capsys, rate):
    from eagle3ft.eval.economics import analysis

    run = tmp_path / "run"
    (run / "bench").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        analysis.main(["--config", str(TINY), "--run-dir", str(run), "--tok-s", rate])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].endswith(f"error: argument --tok-s: {rate!r}: a decode rate in tokens/s, a finite number above 0")
    assert sorted(p.name for p in run.iterdir()) == ["bench"]  # nothing recorded


@pytest.mark.parametrize("stage", ["economics", "report"])
def test_a_truncated_bench_summary_is_one_line_naming_it(tmp_path, capsys, stage):
    run = tmp_path / "run"
    (run / "bench").mkdir(parents=True)
    (run / "bench" / "summary.json").write_text('{"prompt_sets": {"chat": {"baseline": {"ms_per')
    with pytest.raises(SystemExit) as e:
        read_side_mains()[stage](["--config", str(TINY), "--run-dir", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    prog = {"economics": "analysis.py", "report": "build.py"}[stage]  # the file run: its main is called directly
    assert err[0].startswith(f"{prog}: error: {run / 'bench' / 'summary.json'}: "), err


@pytest.mark.parametrize("text", [None, "- a\n- list\n", "num_machines: [1\n"])
def test_eagle3ft_train_refuses_an_accelerate_config_that_is_none_in_one_line(tmp_path, capsys, text):
    from eagle3ft.train import launcher

    accel = tmp_path / "accel.yaml"
    if text is not None:
        accel.write_text(text)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        launcher.main(["--accelerate-config", str(accel), "--config", str(TINY), "--run-dir", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"eagle3ft train: error: --accelerate-config {accel}: "), err
    assert not run.exists()


# --------------------------------------------------------------------------- modes and leftovers


def test_exported_weights_are_readable_as_their_config_json_under_umask_022(tmp_path):
    import os
    import stat

    from test_hardening_train import SavingDist, tiny_drafter

    from eagle3ft.drafter.export import export_drafter
    from eagle3ft.train.checkpoint import save_checkpoint

    old = os.umask(0o022)
    try:
        model = tiny_drafter()
        export_drafter(model, tmp_path / "export")
        save_checkpoint(SavingDist(), model, model.config, tmp_path, 2, {"step": 2}, keep=0)
    finally:
        os.umask(old)
    for folder in (tmp_path / "export", tmp_path / "ckpt" / "step-2"):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
        assert modes["config.json"] == 0o644 and modes["model.safetensors"] == 0o644, (folder, modes)
    assert stat.S_IMODE((tmp_path / "ckpt" / "step-2" / "state.safetensors").stat().st_mode) == 0o644


def test_a_record_left_half_written_by_a_killed_run_is_removed_by_the_next(tmp_path):
    import os
    import subprocess
    import sys

    from eagle3ft.cli import save_resolved
    from eagle3ft.config import load_config

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    run = tmp_path / "run"
    run.mkdir()
    stale = run / f".config.yaml.{dead}.tmp"
    stale.write_text("stages: {harv")
    os.utime(stale, (0, 0))  # long ago
    alive = run / f".config.yaml.{os.getppid()}.tmp"  # a live process's: it may be writing now
    alive.write_text("x")
    os.utime(alive, (0, 0))
    fresh = run / f".config.yaml.{dead + 1_000_000}.tmp"  # just written: left alone this time
    fresh.write_text("x")
    save_resolved(load_config(TINY), run, "harvest")
    assert not stale.exists() and alive.exists() and fresh.exists()
    assert (run / "config.yaml").is_file()
