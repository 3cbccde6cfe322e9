"""The run folder lock: one writer, its owner named, stale locks taken over, re-entrant in one process."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from eagle3ft.run_dir import LOCK_NAME
from eagle3ft.runlock import RunLocked, check_owner, run_lock


@pytest.fixture
def live_pid():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def plant(run, **owner) -> dict:
    run.mkdir(parents=True, exist_ok=True)
    owner = {"host": socket.gethostname(), "stage": "harvest", "started": "2026-11-30T10:00:00+0000", **owner}
    (run / LOCK_NAME).write_text(json.dumps(owner))
    return owner


def test_the_lock_names_its_owner_and_goes_away_after(tmp_path):
    with run_lock(tmp_path / "run", "eval"):
        owner = json.loads((tmp_path / "run" / LOCK_NAME).read_text())
        assert (
            owner["pid"] == os.getpid()
            and owner["host"] == socket.gethostname()
            and owner["stage"] == "eval"
            and owner["started"]
        )
        check_owner(tmp_path / "run", socket.gethostname(), os.getpid())
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_second_writer_stops_naming_the_owner(tmp_path, live_pid):
    owner = plant(tmp_path, pid=live_pid)
    with pytest.raises(
        RunLocked,
        match=rf"^{tmp_path} is in use by harvest \(pid {live_pid} on {socket.gethostname()}, since "
        r"2026-11-30T10:00:00\+0000\); wait",
    ) as e:
        run_lock(tmp_path, "train").acquire()
    assert "\n" not in str(e.value)
    assert json.loads((tmp_path / LOCK_NAME).read_text()) == owner  # untouched


def test_a_second_writer_in_another_process_is_refused(tmp_path):
    code = (
        "import sys; from eagle3ft.runlock import run_lock, RunLocked\ntry:\n run_lock(sys.argv[1], "
        "'bench').acquire()\nexcept RunLocked as e:\n print(e); sys.exit(3)"
    )
    with run_lock(tmp_path, "report"):
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 3 and f"in use by report (pid {os.getpid()}" in r.stdout


def test_a_stale_lock_is_taken_over_with_a_message(tmp_path, capsys):
    pid = dead_pid()
    plant(tmp_path, pid=pid)
    with run_lock(tmp_path, "train"):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"taking over the stale lock {tmp_path / LOCK_NAME} of harvest (pid {pid}" in capsys.readouterr().err


def test_a_lock_from_another_host_is_never_taken_over(tmp_path):
    plant(tmp_path, pid=dead_pid(), host="some-other-node")
    with pytest.raises(RunLocked, match="in use by harvest .* on some-other-node"):
        run_lock(tmp_path, "train").acquire()


def test_reentrant_in_one_process_and_released_by_the_outermost(tmp_path):
    outer = run_lock(tmp_path, "bench").acquire()
    with run_lock(tmp_path, "bench"):
        pass
    assert (tmp_path / LOCK_NAME).exists()
    outer.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_check_owner_refuses_a_lock_of_someone_else(tmp_path, live_pid):
    plant(tmp_path, pid=live_pid)
    with pytest.raises(RunLocked, match=f"held by harvest \\(pid {live_pid}.*not by this launch's rank 0 \\(pid 1 on"):
        check_owner(tmp_path, socket.gethostname(), 1)
    with pytest.raises(RunLocked, match="held by nobody"):
        check_owner(tmp_path / "elsewhere", socket.gethostname(), 1)


def test_a_lock_left_by_a_stage_that_raised_is_removed_at_exit(tmp_path):
    code = (
        "import sys; from eagle3ft.runlock import run_lock\nrun_lock(sys.argv[1], 'harvest').acquire()\nraise "
        "SystemExit(4)"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 4 and not (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize(
    "module, entry",
    [
        ("eagle3ft.data.harvest", "main"),
        ("eagle3ft.data.regen", "main"),
        ("eagle3ft.eval.offline.accept_len", "main"),
        ("eagle3ft.eval.bench.live", "main"),
        ("eagle3ft.eval.economics.analysis", "main"),
        ("eagle3ft.eval.report.build", "main"),
    ],
)
def test_every_stage_stops_on_a_folder_in_use_and_writes_nothing(tmp_path, live_pid, capsys, module, entry):
    import importlib

    from train_fixtures import REPO

    owner = plant(tmp_path, pid=live_pid, stage="train")
    with pytest.raises(SystemExit) as e:
        getattr(importlib.import_module(module), entry)(
            ["--config", str(REPO / "configs/tiny.yaml"), "--run-dir", str(tmp_path)]
        )
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"error: {tmp_path} is in use by train (pid {live_pid} on {owner['host']}" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]


@pytest.mark.parametrize(
    "text, what",
    [
        ("", "empty"),
        ('{"host": "node-1", "pid": 12', "28 bytes that are no owner record: cut short or damaged"),
        ("[]", "2 bytes that are no owner record"),
    ],
)
def test_an_empty_or_truncated_lock_left_long_ago_is_taken_over_saying_what_it_was(tmp_path, capsys, text, what):
    (tmp_path / LOCK_NAME).write_text(text)
    old = os.stat(tmp_path / LOCK_NAME).st_mtime - 3600
    os.utime(tmp_path / LOCK_NAME, (old, old))
    with run_lock(tmp_path, "train"):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert f"train: taking over the unreadable lock {tmp_path / LOCK_NAME} ({what}" in err
    assert "unchanged for 3600 s, so no stage is writing it" in err


def test_a_lock_being_written_is_waited_for_and_one_never_written_is_taken_over_after_the_grace(
    tmp_path, live_pid, monkeypatch, capsys
):
    import threading

    import eagle3ft.runlock as runlock

    monkeypatch.setattr(runlock, "UNREADABLE_GRACE_S", 2.0)
    (tmp_path / LOCK_NAME).write_text("")  # just created by its owner, which writes its record 0.3 s later
    writer = threading.Timer(0.3, plant, (tmp_path,), {"pid": live_pid})
    writer.start()
    with pytest.raises(RunLocked, match=rf"in use by harvest \(pid {live_pid}"):
        run_lock(tmp_path, "train").acquire()
    writer.join()
    (tmp_path / LOCK_NAME).write_text("")  # an owner killed before it wrote its record
    t0 = time.monotonic()
    with run_lock(tmp_path, "train"):
        assert 1.9 < time.monotonic() - t0 < 10
    assert "taking over the unreadable lock" in capsys.readouterr().err
