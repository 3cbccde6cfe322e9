"""A launched rank and its launcher (torchrun's elastic agent, which `accelerate launch` runs in its own process).

- `watch_launcher`: a rank exits when its launcher dies (torchrun starts the ranks in their own session, so a
  `kill -9` of the launcher's process group would otherwise leave them running).
- `loopback_only`: on one machine the ranks' own sockets (gloo's pairs, NCCL's bootstrap) listen on the loopback
  interface only. The agent's rendezvous store is another matter: c10d's TCPStore server listens on every interface
  whatever host it is given (torch 2.13: `::`, then `0.0.0.0`), and neither torchrun nor accelerate 1.16 lets a
  config bind it.
- `end_launch`: after an input error, the launch ends with the stage's one line. The agent turns any non-zero
  exit of a rank into a ChildFailedError, which accelerate 1.16 re-raises (a ~45-line traceback) or, with
  `--quiet`, prints as its ~20-line failure table; no exit code of a rank makes it quiet. So rank 0 ends the other
  ranks of its machine and the agent (SIGKILL, as the agent would after its grace period: the launch's exit status
  is 137), and a failing rank other than 0 waits for that rather than exit, so the agent never reports a failed rank.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
AGENTS = ("accelerate", "torchrun", "torch.distributed.run", "torch/distributed/run.py")


def watch_launcher(poll_s: float = 0.5) -> None:
    """Exit this process when its parent (the launcher) dies.

    On Linux the kernel sends SIGKILL at the parent's death (prctl PR_SET_PDEATHSIG); a daemon thread
    also polls the parent pid, which covers other platforms and a parent that died before the prctl.
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(
            f"rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): its launcher (pid {parent}) is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    threading.Thread(target=poll, name="launcher-watch", daemon=True).start()


def one_machine() -> bool:
    return os.environ.get("WORLD_SIZE", "1") == os.environ.get("LOCAL_WORLD_SIZE", "1")


def loopback_only() -> None:
    """On one machine the ranks' sockets listen on the loopback interface: gloo's (GLOO_SOCKET_IFNAME) and NCCL's
    bootstrap (NCCL_SOCKET_IFNAME), unless already set. By default both take the interface of the host name's
    address, which may face the network."""
    if not one_machine():
        return
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if names else ():
        os.environ.setdefault(var, names[0])


def _agent() -> int | None:
    """The pid of the elastic agent that started this rank, or None when another process started it."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    parent = os.getppid()
    try:
        cmdline = Path(f"/proc/{parent}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return parent if any(name in cmdline for name in AGENTS) else None


def _children(pid: int) -> list[int]:
    """The other ranks the agent started (its children, on this machine)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(c) for c in task.read_text().split()]
        except OSError:
            pass
    return out


def end_launch(is_main: bool, wait_s: float = 10.0) -> bool:
    """After an input error: rank 0 ends this machine's ranks and the agent; another rank waits (up to `wait_s`) for
    that to happen. True when the launch ended (or no agent started this rank), so this rank may stay quiet."""
    agent = _agent()
    if agent is None:
        return True
    if is_main:
        for pid in [*_children(agent), agent]:
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return True
    deadline = time.monotonic() + wait_s
    while os.getppid() == agent and time.monotonic() < deadline:
        time.sleep(0.05)
    return os.getppid() != agent
