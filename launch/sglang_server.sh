#!/usr/bin/env bash
# One SGLang server from the config's `serve` section, in the foreground; Ctrl-C stops it and its workers.
#   bash launch/sglang_server.sh harvest|baseline|speculative CONFIG RUN_DIR [--drafter DIR] [--setting 3/1/4] [--port N] [--set k=v ...]
# On each node of a multi-node harvest:  bash launch/sglang_server.sh harvest CONFIG RUN_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
ROLE=$1 CONFIG=$2 RUN=$3
shift 3
exec python -m eagle3ft.targets.sglang_server --role "$ROLE" --config "$CONFIG" --run-dir "$RUN" "$@"
