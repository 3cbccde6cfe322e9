"""Issue 41 item 4: a one-machine launch listens on loopback only, the launcher's rendezvous store included.

A real two-process CPU training, through `eagle3ft-train`, through `accelerate launch --rdzv_backend
eagle3ft-loopback` and through a plain `accelerate launch --config_file configs/accelerate/cpu-2proc.yaml` (its
mpirun_config carries the rendezvous: accelerate 1.16 ignores a config file's top-level rdzv_backend); while it runs,
the listening TCP sockets of the launcher and of every process under it are read from /proc."""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from train_fixtures import REPO, launch_cmd, write_store

from eagle3ft.train.launcher import LOOPBACK_RDZV, create_loopback_rendezvous, launch_args

LOOPBACK = ("0100007F:", "00000000000000000000000001000000:", "0000000000000000FFFF00000100007F:")  # 127.0.0.1, ::1


def _tree(pid: int) -> list[int]:
    """`pid` and every process under it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").glob("*/children"):
                todo += [int(c) for c in task.read_text().split()]
        except OSError:  # the process or a thread of it ended meanwhile
            pass
    return out


def _listening() -> dict[str, str]:
    """Socket inode -> local address (hex, as /proc/net/tcp* shows it) of every listening TCP socket."""
    rows = [line.split() for f in ("/proc/net/tcp", "/proc/net/tcp6") for line in open(f).readlines()[1:]]
    return {r[9]: r[1] for r in rows if r[3] == "0A"}


def _sockets(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:  # gone meanwhile
        pass
    return inodes


def _watch(cmd: list[str]) -> tuple[subprocess.CompletedProcess, dict[int, set[str]]]:
    """Run `cmd`; every 0.1 s until it ends, the listening addresses of its processes (pid -> addresses)."""
    seen: dict[int, set[str]] = {}
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: nothing blocks on output no one reads yet
        with subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True) as p:
            deadline = time.monotonic() + 600
            while p.poll() is None and time.monotonic() < deadline:
                listening = _listening()
                for pid in _tree(p.pid):
                    seen.setdefault(pid, set()).update(listening[i] for i in _sockets(pid) if i in listening)
                time.sleep(0.1)
            p.kill()
            rc = p.wait()
        log.seek(0)
        out = log.read()
    return subprocess.CompletedProcess(cmd, rc, out), seen


@pytest.mark.slow  # ~20 s per launch path on a loaded 2-core machine
@pytest.mark.parametrize("path", ["accelerate launch --rdzv_backend", "eagle3ft-train", "plain accelerate launch"])
def test_a_one_machine_launch_listens_on_loopback_only(tmp_path, path):
    run = tmp_path / "run"
    write_store(run, n_train=4, n_heldout=1)
    cmd = launch_cmd(run, "train.schedule.max_steps=2")
    if path == "accelerate launch --rdzv_backend":
        i = cmd.index("--main_process_port")
        cmd[i:i] = ["--rdzv_backend", "eagle3ft-loopback"]
    elif path == "eagle3ft-train":  # the console script, with the same accelerate config and arguments
        script = Path(sys.executable).with_name("eagle3ft-train")
        cmd = [str(script), "--accelerate-config", cmd[4], *cmd[cmd.index("--config") :]]
    r, seen = _watch(cmd)
    assert r.returncode == 0, r.stdout[-3000:]
    launcher = seen.pop(next(iter(seen)))  # the first pid seen is the launcher (the agent's process)
    assert launcher, "the launcher's rendezvous store was never seen listening"
    assert sum(1 for addrs in seen.values() if addrs) >= 2, seen  # both ranks' gloo sockets were seen
    outside = sorted(a for a in launcher.union(*seen.values()) if not a.startswith(LOOPBACK))
    assert not outside, f"listening on {outside} (hex address:port, /proc/net/tcp*); launcher {launcher}"


def test_eagle3ft_train_picks_the_loopback_rendezvous_for_one_machine_only():
    for name in ("cpu-2proc", "1gpu", "2gpu", "8gpu"):
        assert launch_args(REPO / f"configs/accelerate/{name}.yaml") == [
            "--rdzv_backend",
            LOOPBACK_RDZV,
            "--main_process_port",
            "0",
        ]
    assert launch_args(REPO / "configs/accelerate/multi-node.yaml") == []  # static: the other hosts must reach it
    with pytest.raises(ValueError, match="is for one machine"):
        create_loopback_rendezvous(SimpleNamespace(max_nodes=2, run_id="x", config={}))
