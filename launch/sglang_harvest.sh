#!/usr/bin/env bash
# Harvest through SGLang on this node: start the harvest server (serve.*), run data/harvest.py against it
# (harvest.sglang.urls must name it), stop the server. Rerunning resumes at the first unfinished shard.
#   bash launch/sglang_harvest.sh CONFIG RUN_DIR [--set k=v ...]
# Several nodes: `bash launch/sglang_server.sh harvest CONFIG RUN_DIR` on each, then on one of them
#   python data/harvest.py --config CONFIG --run-dir RUN_DIR --set 'harvest.sglang.urls=[http://node1:30000, http://node2:30000]'
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=$1 RUN=$2
shift 2
python -m eagle3ft.targets.sglang_server --role harvest --config "$CONFIG" --run-dir "$RUN" "$@" \
  -- python data/harvest.py --config "$CONFIG" --run-dir "$RUN" "$@"
