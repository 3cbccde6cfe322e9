#!/usr/bin/env bash
# Kimi-K2.5 on one 8-GPU node, SGLang for the target: harvest -> train -> offline eval -> live bench -> report.
#   bash launch/kimi-k25-8gpu.sh [RUN_DIR] [--set k=v ...]     (default runs/kimi-k25)
# Needs /models/Kimi-K2.5 and /models/Kimi-K2-Instruct-eagle3 (or --set target.path=... etc.) and an
# SGLang interpreter in serve.python. Every stage resumes when rerun. docs/sglang.md has the details.
# Learnt on a K2-architecture target in real SGLang 0.5.17 (docs/sglang.md, "The K2 path on real SGLang"):
# - the drafter's aux ids [2, 30, 58] are taken as given on Kimi (the outputs of layers 1, 29, 57); the harvest, the
#   embedded checks and the export's vLLM ids all follow that rule, so keep the ids of the drafter you warm-start;
# - a harvest server's first start compiles for minutes (serve.startup_timeout_s), later ones are faster;
# - each K2 checkpoint is ~16.7 GB: leave train.keep_checkpoints x 16.7 GB free under RUN/ckpt;
# - after the bench's first requests, read the servers' spec_accept_length: 1.00 means the drafter is not drafting.
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${KIMI_CONFIG:-configs/kimi-k25-8gpu.yaml}
RUN=${1:-runs/kimi-k25}
shift $(( $# > 0 ? 1 : 0 ))
stage() { printf '\n== %s\n' "$1"; }

stage "harvest: the EAGLE3 harvest server (AQ-MedAI draft selects layers 2/30/58) regenerates the answers"
bash launch/sglang_harvest.sh "$CONFIG" "$RUN" "$@"

stage "train: TTT fine-tuning from the AQ-MedAI drafter on 8 GPUs"
eagle3ft-train --accelerate-config configs/accelerate/8gpu.yaml --config "$CONFIG" --run-dir "$RUN" --resume auto "$@"

stage "offline accept length"
python eval/offline/accept_len.py --config "$CONFIG" --run-dir "$RUN" "$@"

stage "live benchmark on SGLang (servers started one at a time: serve.max_servers)"
bash launch/sglang_bench.sh "$CONFIG" "$RUN" "$@"

stage "report"
python eval/report/build.py --config "$CONFIG" --run-dir "$RUN" "$@"
