"""One writer per run folder: a lock file that names its owner.

Every stage that writes `runs/<name>/` (harvest, regen, train, offline eval, bench, report) holds
`<run>/.lock` while it runs. The file is created with O_EXCL and holds the owner's host, pid, stage
and start time as JSON. A second writer stops with one line naming the owner. A lock whose pid is
dead on this host is stale (its owner was killed): it is taken over with a message. A lock from
another host is never taken over: only its owner, or a person who deletes the file, can clear it. A lock
file without an owner record (empty, or cut short) that stays so for UNREADABLE_GRACE_S has no writer (its
owner writes the record right after creating the file): it is taken over too, with a message saying what it was.
Re-entrant within one process (a stage that calls another stage keeps the one lock).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from eagle3ft.files import DiskFull, disk_full, json_text
from eagle3ft.run_dir import RunDir

UNREADABLE_GRACE_S = 5.0  # an owner writes its record at once: a lock unreadable for this long has no writer
_held: dict[Path, list] = {}  # lock path -> [nesting depth, owner record], for this process


class RunLocked(RuntimeError):
    """Another live process holds the run folder."""


def lock_path(run_dir: str | Path) -> Path:
    return RunDir(run_dir).lock


def read_owner(path: Path) -> dict | None:
    """The lock's owner record; None when the file is gone; {} when it holds none (being written, empty, cut short)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        owner = json.loads(text)
    except json.JSONDecodeError:
        return {}
    is_record = isinstance(owner, dict) and isinstance(owner.get("host"), str) and isinstance(owner.get("pid"), int)
    return owner if is_record else {}


def pid_alive(pid: int) -> bool:
    """True when `pid` is a live (not zombie) process on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return sys.platform != "linux"


def describe(owner: dict) -> str:
    return (
        f"{owner.get('stage', '?')} (pid {owner.get('pid', '?')} on {owner.get('host', '?')}, since "
        f"{owner.get('started', '?')})"
    )


def _stale(owner: dict) -> bool:
    return (
        owner.get("host") == socket.gethostname() and isinstance(owner.get("pid"), int) and not pid_alive(owner["pid"])
    )


class RunLock:
    """Holds `<run_dir>/.lock` from `acquire()` until `release()`; also a context manager."""

    def __init__(self, run_dir: str | Path, stage: str) -> None:
        self.path = lock_path(run_dir).resolve()
        self.stage = stage
        self.owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "stage": stage,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def acquire(self) -> "RunLock":
        if self.path in _held:
            _held[self.path][0] += 1
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = read_owner(self.path)
                if owner is None:
                    continue  # released meanwhile: try again
                if owner and _stale(owner):
                    print(
                        f"{self.stage}: taking over the stale lock {self.path} of {describe(owner)}: that process is "
                        "gone",
                        file=sys.stderr,
                        flush=True,
                    )
                    self._remove_if(owner)
                    continue
                if not owner:
                    self._take_over_unreadable()  # after its owner has had the time to write it
                    continue
                raise RunLocked(
                    f"{self.path.parent} is in use by {describe(owner)}; wait for it to finish (or, if it is gone, "
                    f"delete {self.path})"
                )
            try:
                with disk_full(self.path), os.fdopen(fd, "w") as f:
                    f.write(json_text(self.owner, str(self.path)) + "\n")
            except BaseException:  # a full disk, a kill: no lock without its owner's record is left behind
                self.path.unlink(missing_ok=True)
                raise
            _held[self.path] = [1, self.owner]
            return self
        raise RunLocked(
            f"{self.path}: could not take the lock (it kept changing hands); delete it if no stage is running"
        )

    def _take_over_unreadable(self) -> None:
        """Wait until the lock holds an owner record; if none comes within UNREADABLE_GRACE_S of the file's last
        write, no process is writing it (one killed between creating and writing it, a full disk, a partial copy):
        remove it, saying so."""
        while True:
            try:
                age, data = time.time() - self.path.stat().st_mtime, self.path.read_bytes()
            except FileNotFoundError:
                return
            if read_owner(self.path) or age >= UNREADABLE_GRACE_S:
                break
            time.sleep(0.05)
        if read_owner(self.path):
            return  # written meanwhile: the caller reads its owner
        what = "empty" if not data.strip() else f"{len(data)} bytes that are no owner record: cut short or damaged"
        print(
            f"{self.stage}: taking over the unreadable lock {self.path} ({what}; unchanged for {age:.0f} s, so no "
            "stage is writing it)",
            file=sys.stderr,
            flush=True,
        )
        try:
            if self.path.read_bytes() == data:
                self.path.unlink()
        except FileNotFoundError:
            pass

    def _remove_if(self, owner: dict) -> None:
        if read_owner(self.path) == owner:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def release(self) -> None:
        held = _held.get(self.path)
        if held is None:
            return
        held[0] -= 1
        if held[0] == 0:
            del _held[self.path]
            self._remove_if(held[1])

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@atexit.register
def release_all() -> None:
    """Remove the lock files this process still holds: at interpreter exit (a stage that raised), and before a rank
    ends its launch (eagle3ft/cli.py's cli_errors: the launcher's death kills this process, atexit handlers unrun)."""
    for path, (_, owner) in list(_held.items()):
        del _held[path]
        if read_owner(path) == owner:
            path.unlink(missing_ok=True)


def run_lock(run_dir: str | Path, stage: str) -> RunLock:
    """`with run_lock(run_dir, "harvest"): ...`: hold the run folder for one stage."""
    return RunLock(run_dir, stage)


@contextmanager
def holding(run_dir: str | Path, stage: str, prog: str | None = None):
    """An entry point's body with the run folder locked; a folder in use exits 1 with one line naming its owner."""
    try:
        lock = run_lock(run_dir, stage).acquire()
    except (RunLocked, DiskFull) as e:
        print(f"{prog or stage}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    try:
        yield lock
    finally:
        lock.release()


def check_owner(run_dir: str | Path, host: str, pid: int) -> None:
    """Raise RunLocked unless `<run_dir>/.lock` is held by `pid` on `host` (a launch's rank 0)."""
    path = lock_path(run_dir)
    owner = read_owner(path)
    if not owner or owner.get("host") != host or owner.get("pid") != pid:
        held = describe(owner) if owner else "nobody"
        raise RunLocked(f"{path}: held by {held}, not by this launch's rank 0 (pid {pid} on {host})")
