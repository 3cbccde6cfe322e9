"""A launched rank and its launcher (torchrun's elastic agent, which `accelerate launch` runs in its own process).

- `watch_launcher`: a rank exits when its launcher dies (torchrun starts the ranks in their own session, so a
  `kill -9` of the launcher's process group would otherwise leave them running).
- `loopback_only`: on one machine the ranks' own sockets (gloo's pairs, NCCL's bootstrap) listen on the loopback
  interface only. The agent's rendezvous store is another matter: c10d's TCPStore server listens on every interface
  whatever host it is given (torch 2.13: `::`, then `0.0.0.0`), and neither torchrun nor accelerate 1.16 lets a
  config bind it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


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
