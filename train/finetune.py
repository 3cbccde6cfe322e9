"""Fine-tune an EAGLE-3 drafter on a run's feature store: every rank of an `accelerate launch` runs this file.

    accelerate launch --config_file configs/accelerate/cpu-2proc.yaml train/finetune.py \
        --config configs/smollm2-135m.yaml --run-dir runs/smol [--resume auto | --overwrite] [--set train.max_steps=100]

(`eagle3ft train ARGS` is that launch from an installed package: train/launcher.py.) Reads DIR/features and
DIR/vocab.safetensors; writes DIR/ckpt/step-N, DIR/export, DIR/train/metrics.jsonl. A folder whose training has
started is continued (--resume auto) or started over (--overwrite), never both at once; --overwrite removes only what
the trainer wrote, and refuses a folder that is no run (train/outputs.py). On a resume this config's rates, schedule
and batch apply from the next step (train/run_state.py's resume names each that differs from the checkpoint's).
Nothing is removed or recorded in DIR/config.yaml until every check has passed, so a refused start changes nothing.
An input error or refusal is one line from rank 0, whatever the number of processes; its traceback is in
DIR/logs/train-error.log.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

from eagle3ft.cli import cli_errors, error_log, is_rank0, parse_cli, rank0_voice, save_resolved
from eagle3ft.data.store import StoreError
from eagle3ft.runlock import RunLocked, run_lock
from eagle3ft.train.launcher import DESCRIPTION, end_launch, exit_rank, train_parser
from eagle3ft.train.loop import NonFiniteLoss, OutOfMemoryHint, run_training
from eagle3ft.train.outputs import start_over, start_refusal


def main(argv: list[str] | None = None) -> int:
    parser = train_parser("finetune.py")  # also when called in-process
    with rank0_voice(end_launch):
        cfg, run_dir, args = parse_cli(DESCRIPTION, "train", argv, parser, record=False)
    if args.resume is not None:
        checkpoint = dataclasses.replace(cfg.train.checkpoint, resume=args.resume)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, checkpoint=checkpoint))
    rank0 = is_rank0()  # rank 0 holds the run folder's lock and records run_dir/config.yaml
    errors = (StoreError, NonFiniteLoss, OutOfMemoryHint, RunLocked)
    with cli_errors("finetune", *errors, log=error_log(run_dir, "train"), end_launch=end_launch):  # one line
        with run_lock(run_dir, "train") if rank0 else nullcontext():
            with rank0_voice(end_launch):  # a folder in use is named first; then exit 2 before anything loads
                if refused := start_refusal(run_dir, cfg.train.checkpoint.resume, args.overwrite):
                    parser.exit(2, f"{parser.prog}: error: {refused}\n" if rank0 else None)

            def start(resumed: dict | None) -> None:
                """Rank 0, once every check of the run has passed and before it writes anything."""
                if args.overwrite:
                    start_over(run_dir)
                save_resolved(cfg, run_dir, "train", {"resumed": resumed} if resumed else None)

            run_training(cfg, run_dir, on_start=start)
    return 0


if __name__ == "__main__":
    exit_rank(main())
