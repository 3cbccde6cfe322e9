"""Fine-tune an EAGLE-3 drafter on a run's feature store.

    accelerate launch --config_file configs/accelerate/cpu-2proc.yaml train/finetune.py \
        --config configs/smollm2-135m.yaml --run-dir runs/smol [--resume auto | --overwrite] [--set train.max_steps=100]

Reads DIR/features and DIR/vocab.safetensors; writes DIR/ckpt/step-N, DIR/export, DIR/train/metrics.jsonl.
A folder whose training has started is continued (--resume auto) or started over (--overwrite), never both at once;
--overwrite removes only what the trainer wrote, and refuses a folder that is no run (train/outputs.py). On a resume
this config's rates, schedule and batch apply from the next step (train/loop.py's resume names each that differs
from the checkpoint's). Nothing is removed or recorded in DIR/config.yaml until every check has passed, so a refused
start changes nothing. An input error or refusal is one line from rank 0, whatever the number of processes; its
traceback is in DIR/logs/train-error.log.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from contextlib import nullcontext

from eagle3ft.cli import build_parser, cli_errors, error_log, is_rank0, parse_cli, rank0_voice, save_resolved
from eagle3ft.data.store import StoreError
from eagle3ft.runlock import RunLocked, run_lock
from eagle3ft.train.launcher import end_launch, launch_args
from eagle3ft.train.loop import NonFiniteLoss, OutOfMemoryHint, main
from eagle3ft.train.outputs import (
    not_a_run,
    refusal,
    remove_training_outputs,
    run_markers,
    stale_derived,
    training_outputs,
)

DESCRIPTION = "Fine-tune an EAGLE-3 drafter on a run's feature store."


def cli(argv: list[str] | None = None) -> int:
    parser = build_parser(DESCRIPTION)
    parser.prog = "finetune.py"  # also when called in-process
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
    with rank0_voice(end_launch):
        cfg, run_dir, args = parse_cli(DESCRIPTION, "train", argv, parser, record=False)
    if args.resume is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume=args.resume))
    rank0 = is_rank0()  # rank 0 holds the run folder's lock and records run_dir/config.yaml
    errors = (StoreError, NonFiniteLoss, OutOfMemoryHint, RunLocked)
    with cli_errors("finetune", *errors, log=error_log(run_dir, "train"), end_launch=end_launch):  # one line
        with run_lock(run_dir, "train") if rank0 else nullcontext():
            with rank0_voice(end_launch):  # a folder in use is named first
                check_start(parser, run_dir, cfg.train.resume, args.overwrite, rank0)

            def start(resumed: dict | None) -> None:
                """Rank 0, once every check of the run has passed and before it writes anything."""
                if args.overwrite:
                    overwrite(run_dir)
                save_resolved(cfg, run_dir, "train", {"resumed": resumed} if resumed else None)

            main(cfg, run_dir, on_start=start)
    return 0


def check_start(parser, run_dir, resume: str | None, overwrite: bool, rank0: bool) -> None:
    """Exit 2 (one line, from rank 0) before anything loads: a started run folder needs --resume or --overwrite, and
    --overwrite needs a run folder."""
    message = None
    if overwrite and resume is not None:
        message = "--overwrite starts over, --resume (train.resume) continues: give one of them"
    elif overwrite and not run_markers(run_dir):
        message = not_a_run(run_dir)
    elif not overwrite and resume is None and (found := training_outputs(run_dir)):
        message = refusal(run_dir, found)
    if message is not None:
        parser.exit(2, f"{parser.prog}: error: {message}\n" if rank0 else None)


def overwrite(run_dir) -> None:
    """--overwrite, under the run lock, once the run's checks have passed: the old run's training outputs go before
    anything is written."""
    if removed := remove_training_outputs(run_dir):
        print(f"--overwrite: removed {', '.join(removed)} of {run_dir}", file=sys.stderr, flush=True)
    if stale := stale_derived(run_dir):
        print(
            f"note: {', '.join(f'{run_dir}/{n}' for n in stale)} describe the old run's drafter; rerun those stages",
            file=sys.stderr,
            flush=True,
        )


def _exit(code: int) -> None:
    """Exit a rank of a multi-process run without C++ static destruction, at the same point as its peers.

    After everything is written and the process group is gone, a ZeRO-3 CPU rank aborted now and then with no Python
    frame left ("terminate called without an active exception": a joinable C++ thread destroyed at teardown; the gloo
    threads of pytorch#179291's kind), hence os._exit. It still aborted in CI (issue 41 item 10), which we put down to
    the ranks leaving at different points: the rank done first os._exited (closing its gloo sockets) while its peer
    was still tearing down. So the engine goes before the process group (Dist.end) and every rank waits here for the
    others (dist.leave_together, through the launcher's store). Logging and stdio are flushed first; atexit handlers
    do not run (the trainer's files, wandb and the run lock are closed before this)."""
    import logging

    from eagle3ft.train.dist import leave_together

    leave_together()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(argv: list[str] | None = None) -> None:
    """`eagle3ft-train`: `accelerate launch --config_file ACCEL -m eagle3ft.train.finetune ARGS`, the same command
    line from an installed package (`--accelerate-config`, default 1gpu.yaml with CUDA, else cpu-2proc.yaml); on one
    machine, with the rendezvous whose store listens on loopback only (launcher.launch_args)."""
    import argparse

    from eagle3ft.config import resolve_path

    ap = argparse.ArgumentParser(prog="eagle3ft-train", description=DESCRIPTION, add_help=False)
    ap.add_argument("--accelerate-config", default=None)
    known, rest = ap.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print("eagle3ft-train [--accelerate-config configs/accelerate/NAME.yaml] FINETUNE-ARGS: accelerate launch of")
        cli(["--help"])
    accel = known.accelerate_config
    if accel is None:
        import torch

        accel = "configs/accelerate/" + ("1gpu.yaml" if torch.cuda.is_available() else "cpu-2proc.yaml")
    accel = resolve_path(accel)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accel), *launch_args(accel)]
    os.execv(sys.executable, cmd + ["-m", "eagle3ft.train.finetune", *rest])


if __name__ == "__main__":
    code = cli()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _exit(code)
    sys.exit(code)
