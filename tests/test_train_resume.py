"""Resume without pickles and across world sizes, the run lock in training, no orphaned ranks (real launches, CPU gloo).

Equivalent batches: 2 processes x micro batch 1 (grad_accum 1) and 1 process x micro batch 1 x grad_accum 2
average the same two samples per optimizer step, so a run can move between them and continue as a
straight run would (to float rounding: the sums are taken in another order).
"""

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import REPO, launch, launch_cmd, write_store

from eagle3ft.run_dir import LOCK_NAME
from eagle3ft.train.checkpoint import (
    FORMAT,
    CheckpointError,
    StateTensors,
    choose_resume,
    read_json,
    read_trainer_state,
)

COMMON = (
    "train.schedule.warmup_steps=2",
    "train.optimizer.lr=3e-3",
    "train.checkpoint.save_every=2",
    "train.checkpoint.keep_checkpoints=3",
    "train.objective.ttt_steps=3",
    "train.schedule.max_steps=6",
)
ONE_PROC = ("train.batch.grad_accum=2",)  # 1 process x 2 micro-batches = the 2-process step


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]


def ok(r) -> None:
    assert r.returncode == 0, r.stderr[-4000:]


def flat(samples: list[list[int]]) -> list[int]:
    return sorted(s for rank in samples for s in rank)


class Payload:
    """Unpickling this creates `marker`: what a planted checkpoint file could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(Payload(marker)))


# Every file the DeepSpeed/accelerate resume read with torch.load(weights_only=False) or pickle, and a few likely names.
OLD_FILES = (
    "state/random_states_0.pkl",
    "state/random_states_1.pkl",
    "state/scheduler.bin",
    "state/optimizer.bin",
    "state/pytorch_model.bin",
    "state/sampler.bin",
    "state/custom_checkpoint_0.pkl",
    "state/pytorch_model/mp_rank_00_model_states.pt",
    "state/pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "state/pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "state/pytorch_model/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "state/pytorch_model/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "training_args.bin",
)


# --------------------------------------------------------------------------- in-process: damaged and planted files


def test_a_planted_pickle_is_refused_naming_the_file_and_never_runs(tmp_path):
    marker = tmp_path / "payload-ran"
    plant(tmp_path / "live.pkl", tmp_path / "live-marker")
    pickle.loads((tmp_path / "live.pkl").read_bytes())
    assert (tmp_path / "live-marker").exists()  # the payload is live: unpickling it does run it

    ck = tmp_path / "step-2"
    plant(ck / "state.safetensors", marker)
    with pytest.raises(CheckpointError, match=rf"^{ck / 'state.safetensors'}: not a readable safetensors file") as e:
        StateTensors(ck / "state.safetensors")
    assert "\n" not in str(e.value)
    plant(ck / "state.json", marker)
    with pytest.raises(CheckpointError, match=rf"^{ck / 'state.json'}: not valid JSON"):
        read_json(ck / "state.json")
    plant(ck / "trainer_state.json", marker)
    with pytest.raises(CheckpointError, match=rf"^{ck / 'trainer_state.json'}: not valid JSON"):
        read_trainer_state(ck)
    assert not marker.exists()


def test_an_old_checkpoint_with_pickled_state_is_refused_with_a_way_out(tmp_path):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 4, "epoch": 0, "batch_in_epoch": 4}))
    with pytest.raises(CheckpointError, match=rf"format None, expected '{FORMAT}'.*drafter.init={tmp_path}"):
        read_trainer_state(tmp_path)


def test_a_truncated_state_file_names_the_file(tmp_path):
    from safetensors.torch import save_file

    save_file({"fp32.w": torch.zeros(1000)}, str(tmp_path / "state.safetensors"))
    data = (tmp_path / "state.safetensors").read_bytes()
    (tmp_path / "state.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"^{tmp_path / 'state.safetensors'}: "):
        StateTensors(tmp_path / "state.safetensors")["fp32.w"]


def test_a_started_run_folder_is_refused_without_resume_or_overwrite_before_anything_loads(
    tmp_path, monkeypatch, capsys
):
    import eagle3ft.train.finetune as finetune

    def boom(*a, **k):
        raise AssertionError("training started")

    monkeypatch.setattr(finetune, "run_training", boom)
    write_store(tmp_path, n_train=2, n_heldout=1)
    (tmp_path / "ckpt" / "step-40").mkdir(parents=True)
    (tmp_path / "ckpt" / "step-40" / "trainer_state.json").write_text(json.dumps({"format": FORMAT, "step": 40}))
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "card.json").write_text(json.dumps({"which": "last", "step": 40}))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    argv = ["--config", str(REPO / "configs/tiny.yaml"), "--run-dir", str(tmp_path)]
    for extra, message in (
        (
            [],
            f"{tmp_path} already holds a training run (ckpt/step-40, export); continue it with --resume auto, or start "
            "over in a new --run-dir or with --overwrite (removes those first)",
        ),
        (["--overwrite", "--resume", "auto"], "--overwrite starts over, --resume (train.resume) continues"),
    ):
        with pytest.raises(SystemExit) as e:
            finetune.main(argv + extra)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"finetune.py: error: {message}"), err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written, no lock left


def fake_checkpoint(folder: Path) -> None:
    """The three files a resume reads, whole (their contents are not a real run's)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({"fp32.w": torch.zeros(100)}, str(folder / "state.safetensors"))
    (folder / "state.json").write_text("{}")
    (folder / "trainer_state.json").write_text(json.dumps({"format": FORMAT, "step": int(folder.name[5:])}))


def test_resume_auto_passes_over_damaged_checkpoints_to_the_newest_that_verifies(tmp_path):
    ckpt = tmp_path / "ckpt"
    for n in (2, 4, 6, 8):
        fake_checkpoint(ckpt / f"step-{n}")
    state = ckpt / "step-6" / "state.safetensors"
    state.write_bytes(state.read_bytes()[:-40])  # cut short
    (ckpt / "step-8" / "trainer_state.json").unlink()
    assert choose_resume(tmp_path, "auto") == (
        ckpt / "step-4",
        [
            f"{ckpt / 'step-8' / 'trainer_state.json'}: missing",
            f"{state}: not a readable safetensors file (Error while deserializing header: incomplete metadata, file "
            "not fully covered)",
        ],
    )
    assert choose_resume(tmp_path, str(ckpt / "step-6")) == (ckpt / "step-6", [])  # named: taken as it is
    assert choose_resume(tmp_path / "fresh", "auto") == (None, [])
    for n in (2, 4):
        (ckpt / f"step-{n}" / "state.json").write_text("")
    with pytest.raises(CheckpointError, match=rf"^--resume auto: no checkpoint in {ckpt} verifies \(.*step-8.*step-2"):
        choose_resume(tmp_path, "auto")


# --------------------------------------------------------------------------- real launches


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 steps on 2 processes, and the same run stopped at step 4 (before resuming) kept aside."""
    run = tmp_path_factory.mktemp("straight")
    write_store(run)
    ok(launch(run, *COMMON))
    stopped = tmp_path_factory.mktemp("stopped")
    write_store(stopped)
    ok(launch(stopped, *COMMON, "train.schedule.stop_after=4"))
    return run, stopped


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_resume_on_the_same_world_size_is_bit_identical_and_loads_no_pickle(straight, tmp_path):
    ref, stopped = straight
    run = copy_run(stopped, tmp_path / "run")
    marker = tmp_path / "payload-ran"
    for name in OLD_FILES:
        plant(run / "ckpt" / "step-4" / name, marker)
    state = json.loads((run / "ckpt" / "step-4" / "trainer_state.json").read_text())
    assert (
        state["format"] == FORMAT
        and state["data"] == {"epoch": 0, "samples_in_epoch": 8, "n_train": 16}
        and state["world_size"] == 2
    )
    ok(launch(run, *COMMON, extra=("--resume", "auto")))
    assert not marker.exists()
    resumed, straight_rows = metrics(run), metrics(ref)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]  # no step twice
    for a, b in zip(resumed, straight_rows):
        assert (a["samples"], a["loss"], a["step_loss"], a["lr"]) == (
            b["samples"],
            b["loss"],
            b["step_loss"],
            b["lr"],
        ), a["step"]
    x, y = load_file(run / "export" / "model.safetensors"), load_file(ref / "export" / "model.safetensors")
    assert all(torch.equal(x[k], y[k]) for k in y)
    assert_same_state(run / "ckpt" / "step-6", ref / "ckpt" / "step-6")  # masters, moments and every rank's RNGs


def assert_same_state(a: Path, b: Path) -> None:
    """Two checkpoints hold the same masters, Adam moments and RNG states (torch, Python, NumPy) of every rank."""
    s_a, s_b = load_file(a / "state.safetensors"), load_file(b / "state.safetensors")
    assert set(s_a) == set(s_b) and {k for k in s_b if k.startswith("rank")} >= {"rank0.torch_cpu", "rank1.numpy_keys"}
    assert [k for k in s_b if not torch.equal(s_a[k], s_b[k])] == []
    assert read_json(a / "state.json")["rng"] == read_json(b / "state.json")["rng"]


@pytest.mark.slow
def test_one_seed_gives_one_run(straight):
    ref, stopped = straight  # two fresh runs of one config: the same state at step 4, RNGs included
    assert_same_state(stopped / "ckpt" / "step-4", ref / "ckpt" / "step-4")


@pytest.mark.slow
def test_two_processes_resume_on_one_and_continue_the_straight_run(straight, tmp_path):
    ref, stopped = straight
    run = copy_run(stopped, tmp_path / "run")
    r = launch(run, *COMMON, *ONE_PROC, procs=1, extra=("--resume", "auto"))
    ok(r)
    assert "written by 2 process(es), now 1" in r.stdout + r.stderr
    resumed, straight_rows = metrics(run), metrics(ref)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed, straight_rows):
        assert flat(a["samples"]) == flat(b["samples"]), a["step"]  # same samples per step: none skipped or seen twice
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]
    assert len(resumed[-1]["samples"]) == 1  # steps 5 and 6 ran on one process
    x, y = load_file(run / "export" / "model.safetensors"), load_file(ref / "export" / "model.safetensors")
    for k in y:
        torch.testing.assert_close(x[k], y[k], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_one_process_resumes_on_two(straight, tmp_path):
    ref, _ = straight
    write_store(tmp_path)
    ok(launch(tmp_path, *COMMON, *ONE_PROC, "train.schedule.stop_after=4", procs=1))
    ok(launch(tmp_path, *COMMON, extra=("--resume", "auto")))
    resumed, straight_rows = metrics(tmp_path), metrics(ref)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [len(r["samples"]) for r in resumed] == [1, 1, 1, 1, 2, 2]
    for a, b in zip(resumed, straight_rows):
        assert flat(a["samples"]) == flat(b["samples"]), a["step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]


@pytest.mark.slow
def test_zero3_checkpoint_from_two_processes_resumes_on_one(straight, tmp_path):
    ref, _ = straight
    write_store(tmp_path)
    z3 = "train.engine.deepspeed=configs/deepspeed/zero3.json"
    ok(launch(tmp_path, *COMMON, z3, "train.schedule.stop_after=4"))
    ok(launch(tmp_path, *COMMON, z3, *ONE_PROC, procs=1, extra=("--resume", "auto")))
    resumed, straight_rows = metrics(tmp_path), metrics(ref)
    assert [len(r["samples"]) for r in resumed] == [2, 2, 2, 2, 1, 1]
    for a, b in zip(resumed, straight_rows):  # against the ZeRO-2 run: the same steps, sharded differently
        assert flat(a["samples"]) == flat(b["samples"]), a["step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
    x, y = load_file(tmp_path / "export" / "model.safetensors"), load_file(ref / "export" / "model.safetensors")
    for k in y:
        torch.testing.assert_close(x[k], y[k], rtol=1e-3, atol=1e-5)


@pytest.mark.slow
def test_a_position_that_does_not_split_over_the_processes_is_refused(straight, tmp_path):
    _, stopped = straight
    run = copy_run(stopped, tmp_path / "run")  # 8 samples consumed; 2 processes x micro batch 3 = rounds of 6
    r = launch(run, *COMMON, "train.batch.micro_batch_size=3", extra=("--resume", "auto"))
    assert r.returncode != 0
    assert "8 samples of epoch 0 consumed do not split into rounds of 6" in r.stderr, r.stderr[-3000:]


@pytest.mark.slow
def test_a_planted_state_file_stops_the_resume_naming_it(straight, tmp_path):
    _, stopped = straight
    run = copy_run(stopped, tmp_path / "run")
    marker = tmp_path / "payload-ran"
    plant(run / "ckpt" / "step-4" / "state.safetensors", marker)
    r = launch(run, *COMMON, procs=1, extra=("--resume", str(run / "ckpt" / "step-4")))  # named: no fall-back
    assert r.returncode != 0 and not marker.exists()  # 137: the launch ends with its one line (train/launcher.py)
    err = [line for line in r.stderr.splitlines() if line.startswith("finetune: error:")]
    assert err and f"{run / 'ckpt' / 'step-4' / 'state.safetensors'}: not a readable safetensors file" in err[0], (
        r.stderr[-3000:]
    )


@pytest.mark.slow
def test_a_finished_run_is_never_restarted_silently_and_overwrite_starts_it_over(straight, tmp_path):
    ref, _ = straight
    run = copy_run(ref, tmp_path / "run")
    before = {p.relative_to(run): p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    r = launch(run, *COMMON, "train.schedule.max_steps=2")
    assert r.returncode != 0 and r.stderr.count("finetune.py: error: ") == 1, r.stderr[-3000:]  # from rank 0 alone
    outputs = "ckpt/step-2, ckpt/step-4, ckpt/step-6, export, export-best, train/metrics.jsonl, train/data.json"
    assert f"finetune.py: error: {run} already holds a training run ({outputs})" in r.stderr
    assert {p.relative_to(run): p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == before
    r = launch(run, *COMMON, "train.schedule.max_steps=2", extra=("--overwrite",))
    ok(r)
    assert f"--overwrite: removed {outputs} of {run}" in r.stderr
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["step-2"]  # none of the old run's checkpoints
    assert [x["step"] for x in metrics(run)] == [1, 2] and metrics(run)[0]["loss"] == metrics(ref)[0]["loss"]
    assert all(json.loads((run / d / "card.json").read_text())["step"] <= 2 for d in ("export", "export-best"))


@pytest.mark.slow
def test_resume_auto_falls_back_from_a_truncated_newest_checkpoint_and_continues_the_straight_run(straight, tmp_path):
    ref, stopped = straight
    run = copy_run(stopped, tmp_path / "run")
    state = run / "ckpt" / "step-4" / "state.safetensors"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    r = launch(run, *COMMON, extra=("--resume", "auto"))
    ok(r)
    out = r.stdout + r.stderr
    assert f"--resume auto: passed over a damaged checkpoint: {state}: not a readable safetensors file" in out
    assert f"resumed from {run / 'ckpt' / 'step-2'} at step 2" in out
    resumed, straight_rows = metrics(run), metrics(ref)
    assert [x["step"] for x in resumed] == [1, 2, 3, 4, 5, 6]
    assert [(x["samples"], x["loss"]) for x in resumed] == [(x["samples"], x["loss"]) for x in straight_rows]
    assert_same_state(run / "ckpt" / "step-6", ref / "ckpt" / "step-6")
    assert_same_state(run / "ckpt" / "step-4", ref / "ckpt" / "step-4")  # the damaged one written anew


# --------------------------------------------------------------------------- run lock and launcher death


def ranks_of(run_dir: Path, launcher: int) -> list[int]:
    """Pids of live processes running finetune.py on `run_dir`, the launcher aside."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == launcher:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "finetune.py" in cmd and str(run_dir) in cmd and state != "Z":
            found.append(int(d.name))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killing_the_launchers_process_group_leaves_no_rank_and_the_lock_is_taken_over(tmp_path):
    write_store(tmp_path)
    log = open(tmp_path / "launch.log", "w")
    p = subprocess.Popen(
        launch_cmd(
            tmp_path,
            "train.schedule.max_steps=100000",
            "train.checkpoint.save_every=100000",
            "train.objective.ttt_steps=3",
        ),
        cwd=REPO,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    ranks: list[int] = []
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (tmp_path / "train" / "metrics.jsonl").exists():
            assert p.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
            time.sleep(0.5)
        ranks = ranks_of(tmp_path, p.pid)
        assert len(ranks) == 2, ranks
        owner = json.loads((tmp_path / LOCK_NAME).read_text())
        assert owner["pid"] in ranks and owner["stage"] == "train"
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        deadline = time.time() + 10
        while time.time() < deadline and ranks_of(tmp_path, p.pid):
            time.sleep(0.2)
        assert ranks_of(tmp_path, p.pid) == [], "ranks outlived their launcher"
    finally:
        for pid in ranks_of(tmp_path, p.pid) if ranks else []:
            os.kill(pid, signal.SIGKILL)
        log.close()
    assert (tmp_path / LOCK_NAME).exists()  # the killed rank 0 could not remove it: stale
    r = subprocess.run(
        launch_cmd(tmp_path, "train.schedule.max_steps=1", "train.objective.ttt_steps=3", procs=1) + ["--overwrite"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    ok(r)
    assert f"taking over the stale lock {tmp_path / LOCK_NAME} of train (pid {owner['pid']}" in r.stderr
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.slow
def test_a_second_training_on_a_locked_run_folder_stops_naming_the_owner(tmp_path):
    write_store(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        owner = {
            "host": socket.gethostname(),
            "pid": holder.pid,
            "stage": "harvest",
            "started": "2026-11-30T10:00:00+0000",
        }
        (tmp_path / LOCK_NAME).write_text(json.dumps(owner))
        r = launch(tmp_path, "train.schedule.max_steps=1", "train.objective.ttt_steps=3")
        assert r.returncode != 0
        assert f"finetune: error: {tmp_path} is in use by harvest (pid {holder.pid} on {owner['host']}" in r.stderr, (
            r.stderr[-3000:]
        )
        assert not (tmp_path / "ckpt").exists() and json.loads((tmp_path / LOCK_NAME).read_text()) == owner
    finally:
        holder.kill()
        holder.wait()
