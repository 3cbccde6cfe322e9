"""A launched rank and its launcher (torchrun's elastic agent, which `accelerate launch` runs in its own process).

- `main`: `eagle3ft train` (and `eagle3ft-train`), the `accelerate launch` of train/finetune.py from an installed
  package; `train_parser` is the trainer's command line, which both show in their help.
- `exit_rank`: how a rank of a launch of several processes exits (no C++ teardown, every rank at the same point).
- `watch_launcher`: a rank exits when its launcher dies (torchrun starts the ranks in their own session, so a
  `kill -9` of the launcher's process group would otherwise leave them running).
- `loopback_only`: on one machine the ranks' own sockets (gloo's pairs, NCCL's bootstrap) listen on the loopback
  interface only.
- `LoopbackRendezvous`: torchrun's rendezvous for one machine (`--rdzv_backend eagle3ft-loopback`, registered
  through the `torchrun.handlers` entry point in pyproject.toml), whose store listens on 127.0.0.1 only. torchrun's
  own backends cannot do that: c10d's TCPStore server listens on every interface (`::`, then `0.0.0.0`) whatever
  host it is given, unless it is handed a listening socket (`master_listen_fd`), which only a rendezvous handler
  can do. `eagle3ft-train` adds the flag for a one-machine config (`launch_args`); a plain `accelerate launch`
  needs it on its command line, as accelerate 1.16 ignores `rdzv_backend` in a config file (its command-line
  default, static, wins).
- `clear_stale_build_locks`: torch's JIT extension builds (DeepSpeed's CPU communication op, built at a rank's first
  start) hold a lock file in their build folder while every other process waits for it to go; a build killed
  mid-way leaves it, and every later launch then waits forever, printing nothing. Local rank 0 removes a lock older
  than any build takes, and says so.
- `end_launch`: after an input error, the launch ends with the stage's one line. The agent turns any non-zero
  exit of a rank into a ChildFailedError, which accelerate 1.16 re-raises (a ~45-line traceback) or, with
  `--quiet`, prints as its ~20-line failure table; no exit code of a rank makes it quiet. So rank 0 ends the other
  ranks of its machine and the agent (SIGKILL, as the agent would after its grace period: the launch's exit status
  is 137), and a failing rank other than 0 waits for that rather than exit, so the agent never reports a failed rank.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from torch.distributed import PrefixStore, TCPStore

PR_SET_PDEATHSIG = 1
AGENTS = ("accelerate", "torchrun", "torch.distributed.run", "torch/distributed/run.py")
LOOPBACK = "127.0.0.1"
LOOPBACK_RDZV = "eagle3ft-loopback"
DESCRIPTION = "Fine-tune an EAGLE-3 drafter on a run's feature store."
STALE_LOCK_S = 600.0  # DeepSpeed's CPU op builds in about a minute on 2 cores: a lock this old is a killed build's


def clear_stale_build_locks(max_age_s: float = STALE_LOCK_S) -> list[Path]:
    """Remove torch extension build locks (ROOT/py*_*/NAME/lock, ROOT from TORCH_EXTENSIONS_DIR or torch's default)
    older than `max_age_s`, one stderr line each; return them."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    removed = []
    for lock in root.glob("*/*/lock"):
        try:
            age = time.time() - lock.stat().st_mtime
            if age <= max_age_s:
                continue
            lock.unlink()
        except FileNotFoundError:  # another process took it away first
            continue
        removed.append(lock)
        print(f"removed {lock}: {age / 60:.0f} min old, left by a build killed mid-way", file=sys.stderr, flush=True)
    return removed


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


class LoopbackRendezvous:
    """The rendezvous of a one-machine launch: the agent is node 0 of 1 and hosts the store, which listens on
    127.0.0.1 only (a socket bound there, handed to TCPStore as its `master_listen_fd`, on a free port). The ranks
    connect to it as clients (`use_agent_store`: MASTER_ADDR=127.0.0.1, MASTER_PORT=its port).

    The methods of torch's RendezvousHandler, without subclassing it: importing torch's rendezvous package loads
    this module through the entry point, so this module imports that package only when a rendezvous is made."""

    def __init__(self, run_id: str, timeout_s: int) -> None:
        listener = socket.create_server((LOOPBACK, 0))
        self._store = TCPStore(
            LOOPBACK,
            listener.getsockname()[1],
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=listener.detach(),  # the store owns and closes it
        )
        self._run_id = run_id

    def get_backend(self) -> str:
        return LOOPBACK_RDZV

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self):
        from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousStoreInfo

        store = PrefixStore(self._run_id, self._store)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(LOOPBACK, self._store.port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True


def create_loopback_rendezvous(params) -> LoopbackRendezvous:
    """torch's RendezvousParameters -> the handler (one node only)."""
    if params.max_nodes != 1:
        raise ValueError(
            f"rdzv_backend {LOOPBACK_RDZV} is for one machine; several use configs/accelerate/multi-node.yaml"
        )
    return LoopbackRendezvous(params.run_id, int(params.config.get("timeout", 600)))


def rendezvous_backend():
    """The `torchrun.handlers` entry point (pyproject.toml): torchrun calls it for the handler's creator."""
    return create_loopback_rendezvous


def accelerate_config_problem(path: Path) -> str | None:
    """Why `path` is no accelerate config to launch with (None: it is one): missing, unreadable, not a mapping."""
    import yaml

    if not path.is_file():
        return f"--accelerate-config {path}: no such file (configs/accelerate/ holds cpu-2proc.yaml, 1gpu.yaml, ...)"
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        return f"--accelerate-config {path}: not readable YAML ({' '.join(str(e).split())[:200]})"
    if not isinstance(doc, dict):
        return f"--accelerate-config {path}: not an accelerate config (a YAML mapping, found {type(doc).__name__})"
    return None


def launch_args(accelerate_config: Path) -> list[str]:
    """The `accelerate launch` flags for this config: on one machine, the loopback rendezvous, and port 0 for
    accelerate's own check (it would switch a port in use to torchrun's standalone mode, whose store listens on
    every interface; this rendezvous takes a free port of its own)."""
    import yaml

    if not accelerate_config.is_file():  # accelerate names it
        return []
    if (yaml.safe_load(accelerate_config.read_text()) or {}).get("num_machines", 1) != 1:
        return []
    return ["--rdzv_backend", LOOPBACK_RDZV, "--main_process_port", "0"]


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


_peers = None  # (the launch's store, rank, world): kept by Dist.end past destroy_process_group, for leave_together


def wait_for_peers_at_exit(store, rank: int, world: int) -> None:
    """Dist.end, once this rank's process group is gone: `leave_together` waits for the peers through `store`."""
    global _peers
    _peers = (store, rank, world)


def leave_together(timeout_s: float = 60.0) -> None:
    """After Dist.end: wait until every rank of the launch has ended its process group, through the launcher's
    TCPStore (no gloo left to use), so the ranks os._exit at the same point. A peer that never arrives (it died)
    costs `timeout_s`, not a hang."""
    if _peers is None:
        return
    store, rank, world = _peers
    store.set(f"eagle3ft/ended/{rank}", "1")
    try:
        store.wait([f"eagle3ft/ended/{r}" for r in range(world)], timedelta(seconds=timeout_s))
    except Exception:  # a peer died or the launcher went: exit anyway
        pass


def train_parser(prog: str) -> argparse.ArgumentParser:
    """The trainer's command line: the shared options (eagle3ft/cli.py) plus --resume and --overwrite."""
    from eagle3ft.cli import build_parser

    parser = build_parser(DESCRIPTION)
    parser.prog = prog
    parser.add_argument(
        "--resume",
        default=None,
        metavar="auto|CKPT",
        help="continue from the newest checkpoint (auto) or a ckpt/step-N folder; sets train.resume",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start over: remove what the trainer wrote in the run folder (checkpoints, exports, train/ logs) first",
    )
    return parser


def exit_rank(code: int) -> None:
    """End this process with `code`. One process exits as usual. A rank of a launch of several processes first waits
    for its peers (`leave_together`, through the launcher's store, once Dist.end has torn down its engine and
    process group), then flushes logging and stdio and leaves through os._exit: a rank that exits while a peer
    still tears down closes the gloo sockets that peer uses, and C++ static destruction can abort a ZeRO-3 CPU rank
    on a joinable gloo thread ("terminate called without an active exception", pytorch#179291).
    benchmarks/leases/exit_abort_loop.sh counts those aborts. atexit handlers do not run: the trainer's files, wandb and
    the run lock are closed before."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    import logging

    leave_together()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    """`eagle3ft train`: `accelerate launch --config_file ACCEL -m eagle3ft.train.finetune ARGS`, the same command line
    from an installed package (--accelerate-config, default 1gpu.yaml with CUDA, else cpu-2proc.yaml); on one
    machine, with the rendezvous whose store listens on loopback only (`launch_args`). The arguments are checked
    here first, so a wrong one is one line before any process starts."""
    from eagle3ft.config import resolve_path

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--accelerate-config", default=None)
    known, rest = ap.parse_known_args(argv)
    parser = train_parser("eagle3ft train")
    parser.add_argument(
        "--accelerate-config",
        default=None,
        metavar="configs/accelerate/NAME.yaml",
        help="the processes to launch (default: 1gpu.yaml with CUDA, else cpu-2proc.yaml)",
    )
    parser.parse_args(argv)  # --help, or exit 2 on a wrong argument
    accel = known.accelerate_config
    if accel is None:
        import torch

        accel = "configs/accelerate/" + ("1gpu.yaml" if torch.cuda.is_available() else "cpu-2proc.yaml")
    accel = resolve_path(accel)
    if problem := accelerate_config_problem(accel):
        parser.exit(2, f"{parser.prog}: error: {problem}\n")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accel), *launch_args(accel)]
    os.execv(sys.executable, cmd + ["-m", "eagle3ft.train.finetune", *rest])
