"""Fine-tune an EAGLE-3 drafter on a run's feature store.

    accelerate launch --config_file configs/accelerate/cpu-2proc.yaml train/finetune.py \
        --config configs/smollm2-135m.yaml --run-dir runs/smol [--resume auto] [--set train.max_steps=100]

Reads DIR/features and DIR/vocab.safetensors; writes DIR/ckpt/step-N, DIR/export, DIR/train/metrics.jsonl.
"""

from __future__ import annotations

import os
import sys

from eagle3ft.data.config import build_parser, parse_cli, save_resolved
from eagle3ft.data.store import StoreError
from eagle3ft.train.loop import NonFiniteLoss, OutOfMemoryHint, main

DESCRIPTION = "Fine-tune an EAGLE-3 drafter on a run's feature store."


def cli(argv: list[str] | None = None) -> int:
    parser = build_parser(DESCRIPTION)
    parser.add_argument("--resume", default=None, metavar="auto|CKPT", help="continue from the newest checkpoint (auto) or a ckpt/step-N folder; sets train.resume")
    cfg, run_dir, args = parse_cli(DESCRIPTION, "train", argv, parser, record=False)
    if args.resume is not None:
        cfg.train.resume = args.resume
    if int(os.environ.get("RANK", "0")) == 0:  # every rank parses the config; one records it in run_dir/config.yaml
        save_resolved(cfg, run_dir, "train")
    try:
        main(cfg, run_dir)
    except (StoreError, NonFiniteLoss, OutOfMemoryHint, ValueError, FileNotFoundError) as e:
        print(f"finetune: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
