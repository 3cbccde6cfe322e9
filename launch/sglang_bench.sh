#!/usr/bin/env bash
# Live benchmark on SGLang: baseline against EAGLE3 per bench.settings, interleaved, batch 1 then the
# bench.concurrency levels; servers from bench.sglang.baseline_url/speculative_url or started (bench.sglang.launch).
#   bash launch/sglang_bench.sh CONFIG RUN_DIR [--set k=v ...]
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=$1 RUN=$2
shift 2
exec python eval/bench/sglang_backend.py --config "$CONFIG" --run-dir "$RUN" "$@"
