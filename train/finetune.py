"""Fine-tune an EAGLE-3 drafter on a run's feature store.

    accelerate launch --config_file configs/accelerate/cpu-2proc.yaml train/finetune.py \
        --config configs/smollm2-135m.yaml --run-dir runs/smol [--resume auto] [--set train.max_steps=100]

Reads DIR/features and DIR/vocab.safetensors; writes DIR/ckpt/step-N, DIR/export, DIR/train/metrics.jsonl.
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext

from eagle3ft.cli import build_parser, cli_errors, parse_cli, save_resolved
from eagle3ft.data.store import StoreError
from eagle3ft.runlock import RunLocked, run_lock
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
    cfg, run_dir, args = parse_cli(DESCRIPTION, "train", argv, parser, record=False)
    if args.resume is not None:
        cfg.train.resume = args.resume
    rank0 = int(os.environ.get("RANK", "0")) == 0  # rank 0 holds the run folder's lock and records run_dir/config.yaml
    with cli_errors("finetune", StoreError, NonFiniteLoss, OutOfMemoryHint, RunLocked):  # exits 1 with one line
        with run_lock(run_dir, "train") if rank0 else nullcontext():
            if rank0:
                save_resolved(cfg, run_dir, "train")
            main(cfg, run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
