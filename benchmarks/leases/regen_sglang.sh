#!/usr/bin/env bash
# Regeneration through real SGLang on one GPU: answer tokens/s per concurrency, then all of ShareGPT into a token store.
#   bash benchmarks/leases/regen_sglang.sh STEP MODEL_DIR [OUT]        STEP: speed | full | all
# MODEL_DIR  an HF bf16 folder SGLang loads; for SmolLM2 make it with
#            python benchmarks/sglang_target.py export-hf --config configs/smollm2-135m.yaml --out MODEL_DIR
# SGL_DIR    (env) the folder the SGLang 0.5.17 wheels were installed into; on the servers' PYTHONPATH only.
# SERVERS    (env, default 1) plain servers sharing the GPU, ports PORT, PORT+1, ...; each starts once the one
#            before it is healthy (SGLang sizes its KV pool from the memory free at its start) and gets
#            0.85/SERVERS of the memory.
# SKIP_TOKENIZER_INIT (env, default 1) start them with --skip-tokenizer-init (ids in, ids out, no detokenizer).
# Steps (results under OUT, default runs/regen-h200):
#   speed  SPEED_CONVS (default 2000) ShareGPT conversations, first user turn, <= 1024 new tokens, T=0, at each
#          SETTINGS (default 64x8,128x8,256x4,256x8: requests in flight per server x prompts per request):
#          OUT/speed/regen_speed.json, one line per setting on stdout
#   full   every ShareGPT conversation (parts joined), every user turn while the conversation fits MAX_TOTAL
#          (default 4096) tokens, <= MAX_NEW (default 1024) new tokens per answer, MT-Bench held out, at
#          FULL_SETTING (default 128x8): OUT/full/tokens/ + summary.json; resumable (rerun the same command).
#          SOURCES (default "{kind: sharegpt}", e.g. "{kind: sharegpt}, {kind: chitchat}") the training sources
set -euo pipefail
cd "$(dirname "$0")/../.."
(( $# >= 2 )) || { sed -n '2,/^set /{/^#/p}' "$0" >&2; exit 2; }  # no arguments: this header
STEP=$1
MODEL=$(realpath "$2")
OUT=${3:-runs/regen-h200}
SGL_DIR=${SGL_DIR:?set SGL_DIR to the folder the SGLang wheels were installed into (pip install --target)}
PY=${PYTHON:-python}
CONFIG=${REGEN_CONFIG:-configs/smollm2-135m.yaml}
PORT=${PORT:-30000}
SERVERS=${SERVERS:-1}
SERVER_CMD=${SERVER_CMD:--m sglang.launch_server}
MEM=$($PY -c "print(round(0.85 / $SERVERS, 3))")
EXTRA="--cuda-graph-max-bs-decode, 512, --max-running-requests, 1024"
[ "${SKIP_TOKENIZER_INIT:-1}" = 1 ] && EXTRA="$EXTRA, --skip-tokenizer-init"
mkdir -p "$OUT"

TARGET=(--set target.kind=hf --set "target.path=$MODEL" --set target.gguf_file=null)
SERVE=(
  "${TARGET[@]}" --set "serve.launch_cmd=[${SERVER_CMD// /, }]"
  --set "serve.python=$PY" --set "serve.model_path=$MODEL"
  --set serve.attention_backend=triton --set serve.sampling_backend=pytorch --set "serve.mem_fraction_static=$MEM"
  --set "serve.extra_args=[$EXTRA]"
  --set "serve.env={PYTHONPATH: '$SGL_DIR', SGLANG_ENABLE_JIT_DEEPGEMM: '0'}" --set serve.startup_timeout_s=900
)
URLS=()
for ((i = 0; i < SERVERS; i++)); do URLS+=("http://127.0.0.1:$((PORT + i))"); done

with_servers() {  # with_servers COMMAND...: SERVERS plain servers up, one after another, for the command's lifetime
  local cmd=("$@") i
  for ((i = SERVERS - 1; i >= 0; i--)); do
    cmd=($PY -m eagle3ft.targets.sglang_server --role baseline --config "$CONFIG" --run-dir "$OUT/serve" "${SERVE[@]}" --port $((PORT + i)) -- "${cmd[@]}")
  done
  "${cmd[@]}"
}

speed() {
  local url_args=() u
  for u in "${URLS[@]}"; do url_args+=(--url "$u"); done
  with_servers $PY benchmarks/regen_speed.py --config "$CONFIG" "${url_args[@]}" --conversations "${SPEED_CONVS:-2000}" \
    --settings "${SETTINGS:-64x8,128x8,256x4,256x8}" --out "$OUT/speed" "${TARGET[@]}"
}

full() {
  local setting=${FULL_SETTING:-128x8}
  local joined
  joined=$(IFS=,; echo "${URLS[*]}")
  with_servers $PY data/regen.py --config "$CONFIG" --run-dir "$OUT/full" "${TARGET[@]}" \
    --set harvest.backend=sglang --set "harvest.sglang.urls=[${joined//,/, }]" \
    --set "harvest.sglang.concurrency=${setting%x*}" --set "harvest.sglang.prompts_per_request=${setting#*x}" \
    --set "harvest.sources=[${SOURCES:-{kind: sharegpt\}}, {kind: mtbench, split: heldout}]" --set harvest.heldout_fraction=0.0 \
    --set harvest.max_turns=1000 --set "harvest.max_new_tokens=${MAX_NEW:-1024}" --set "harvest.max_total_tokens=${MAX_TOTAL:-4096}" \
    --set harvest.max_prompt_tokens=2048 --set harvest.shard_samples=256 --set harvest.temperature=0.0
}

case $STEP in
  speed) speed ;;
  full) full ;;
  all) speed && full ;;
  *) echo "STEP: speed | full | all" >&2; exit 2 ;;
esac
