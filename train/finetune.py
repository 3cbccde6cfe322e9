"""Fine-tune an EAGLE-3 drafter on a run's feature store.

    accelerate launch --config_file configs/accelerate/cpu-2proc.yaml train/finetune.py \
        --config configs/smollm2-135m.yaml --run-dir runs/smol [--resume auto] [--set train.max_steps=100]

Reads DIR/features and DIR/vocab.safetensors; writes DIR/ckpt/step-N, DIR/export, DIR/train/metrics.jsonl.
An input error is one line from rank 0, whatever the number of processes; its traceback is in
DIR/logs/train-error.log.
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext

from eagle3ft.cli import build_parser, cli_errors, error_log, is_rank0, parse_cli, rank0_voice, save_resolved
from eagle3ft.data.store import StoreError
from eagle3ft.runlock import RunLocked, run_lock
from eagle3ft.train.launcher import end_launch
from eagle3ft.train.loop import NonFiniteLoss, OutOfMemoryHint, main

DESCRIPTION = "Fine-tune an EAGLE-3 drafter on a run's feature store."


def cli(argv: list[str] | None = None) -> int:
    parser = build_parser(DESCRIPTION)
    parser.add_argument(
        "--resume",
        default=None,
        metavar="auto|CKPT",
        help="continue from the newest checkpoint (auto) or a ckpt/step-N folder; sets train.resume",
    )
    with rank0_voice(end_launch):
        cfg, run_dir, args = parse_cli(DESCRIPTION, "train", argv, parser, record=False)
    if args.resume is not None:
        cfg.train.resume = args.resume
    rank0 = is_rank0()  # rank 0 holds the run folder's lock and records run_dir/config.yaml
    errors = (StoreError, NonFiniteLoss, OutOfMemoryHint, RunLocked)
    with cli_errors("finetune", *errors, log=error_log(run_dir, "train"), end_launch=end_launch):  # one line
        with run_lock(run_dir, "train") if rank0 else nullcontext():
            if rank0:
                save_resolved(cfg, run_dir, "train")
            main(cfg, run_dir)
    return 0


def _exit(code: int) -> None:
    """Exit a rank of a multi-process run without C++ static destruction. After everything is written and the process
    group is gone, a ZeRO-3 CPU rank still aborted in ~1 of 8 exits on the 2-core CI machine, with no Python frame
    left ("terminate called without an active exception": a joinable C++ thread destroyed at teardown; the gloo
    threads of pytorch#179291's kind); with this, 0 of 24 under the same load. Logging and stdio are flushed first;
    atexit handlers do not run (the trainer's files, wandb and the run lock are closed before this)."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = cli()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _exit(code)
    sys.exit(code)
