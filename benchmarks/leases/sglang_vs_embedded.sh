#!/usr/bin/env bash
# The SGLang integration against real SGLang on one GPU (the H200 recipe of /work/shared/sglang-h200).
#   bash benchmarks/leases/sglang_vs_embedded.sh STEP MODEL_DIR DRAFTER_DIR [OUT]        STEP: probe | harvest | bench | all
# MODEL_DIR   an HF bf16 folder SGLang loads; for SmolLM2 make it with
#             python benchmarks/sglang_target.py export-hf --config configs/smollm2-135m.yaml --out MODEL_DIR
# DRAFTER_DIR an SGLang-form drafter of that target (config.json naming its aux ids + model.safetensors),
#             e.g. RUN/export of a run; it is the harvest server's draft model and the benchmarked one.
# SGL_DIR     (env) the folder the SGLang 0.5.17 wheels were installed into; it goes on PYTHONPATH of the
#             server processes only (SGLang's own transformers), never of this project's processes.
# Steps, each well under 10 minutes, results under OUT (default runs/sglang-h200):
#   probe    wire facts of a plain and an EAGLE3 server vs the protocol double's (facts-*.json, probe-diff-*.txt)
#   harvest  the same samples harvested through SGLang and embedded (transformers on the GPU), both with
#            the target's own answers and with the dataset's answers (identical tokens), compared
#            (compare-*.json); plus the one-request capture on the EAGLE3 server (rows per verify)
#   bench    baseline vs EAGLE3 (3/1/4, 2/1/3, 1/1/2) live, batch 1 and concurrency 8 (bench/summary.json,
#            bench/concurrency.json, bench/economics.json); the four servers share the GPU and start one after
#            another (SGLang sizes a KV pool from the memory free when its server starts: servers started at
#            once each count the others' pools as theirs and fail); BENCH_MTBENCH, BENCH_PROMPTS, BENCH_TOKENS
#            (env) pick the prompts
set -euo pipefail
cd "$(dirname "$0")/../.."
(( $# >= 3 )) || { sed -n '2,/^set /{/^#/p}' "$0" >&2; exit 2; }  # no arguments: this header
STEP=$1
MODEL=$(realpath "$2")
DRAFTER=$(realpath "$3")
OUT=${4:-runs/sglang-h200}
SGL_DIR=${SGL_DIR:?set SGL_DIR to the folder the SGLang wheels were installed into (pip install --target)}
PY=${PYTHON:-python}
CONFIG=${H200_CONFIG:-configs/smollm2-135m.yaml}
PORT=${PORT:-30000}
DEVICE=${H200_DEVICE:-cuda}                         # cpu + SERVER_CMD=tests/sglang_double.py: a dry run without a GPU
SERVER_CMD=${SERVER_CMD:--m sglang.launch_server}
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"
HIDDEN=$($PY -c "import json,sys; print(json.load(open(sys.argv[1] + '/config.json'))['hidden_size'])" "$MODEL")

COMMON=(
  --set target.kind=hf --set "target.path=$MODEL" --set target.gguf_file=null
  --set target.dtype=bfloat16 --set "target.device=$DEVICE" --set "serve.launch_cmd=[${SERVER_CMD// /, }]"
  --set "drafter.config=$DRAFTER/config.json"
  --set "serve.python=$PY" --set "serve.model_path=$MODEL" --set "serve.port=$PORT"
  --set serve.attention_backend=triton --set serve.sampling_backend=pytorch --set serve.mem_fraction_static=0.25
  --set "serve.env={PYTHONPATH: '$SGL_DIR', SGLANG_ENABLE_JIT_DEEPGEMM: '0'}"
  --set "serve.harvest_draft=$DRAFTER" --set serve.startup_timeout_s=900
  --set "eval.checkpoint=$DRAFTER"
)
# DATA (env): a folder with sharegpt-3000.json and mtbench-questions.jsonl where the packages are not installed
SHAREGPT=${DATA:+, path: $DATA/sharegpt-3000.json}
MTBENCH=${DATA:+, path: $DATA/mtbench-questions.jsonl}
HARVEST=(
  --set "harvest.sources=[{kind: sharegpt, limit: 24$SHAREGPT}, {kind: mtbench, limit: 8, split: heldout$MTBENCH}]"
  --set harvest.max_turns=1 --set harvest.max_prompt_tokens=256 --set harvest.max_total_tokens=512
  --set harvest.max_new_tokens=96 --set harvest.batch_size=32 --set harvest.shard_samples=8 --set harvest.topk=16
  --set "harvest.sglang.urls=[$URL]" --set harvest.sglang.concurrency=8
)
serve() {  # serve ROLE RUN_DIR [sets...] -- COMMAND...: the server up for the command's lifetime
  local role=$1 run=$2
  shift 2
  $PY -m eagle3ft.targets.sglang_server --role "$role" --config "$CONFIG" --run-dir "$run" "${COMMON[@]}" "$@"
}

probe() {
  serve baseline "$OUT/serve-probe" --set 'serve.extra_args=[--enable-return-hidden-states]' \
    -- $PY benchmarks/sglang_probe.py --url "$URL" --hidden-size "$HIDDEN" --out "$OUT/facts-plain.json" >/dev/null
  serve harvest "$OUT/serve-probe" \
    -- $PY benchmarks/sglang_probe.py --url "$URL" --hidden-size "$HIDDEN" --out "$OUT/facts-eagle3.json" >/dev/null
  $PY benchmarks/sglang_probe.py --double plain --hidden-size 64 --out "$OUT/facts-double-plain.json" >/dev/null
  $PY benchmarks/sglang_probe.py --double eagle3 --hidden-size 64 --out "$OUT/facts-double-eagle3.json" >/dev/null
  for kind in plain eagle3; do
    echo "== probe $kind: real SGLang vs the double (differences)"
    $PY benchmarks/sglang_probe.py --compare "$OUT/facts-$kind.json" "$OUT/facts-double-$kind.json" | tee "$OUT/probe-diff-$kind.txt" || true
  done
}

harvest() {
  local regen
  for regen in true false; do
    rm -rf "$OUT/harvest-hf-$regen"
    $PY data/harvest.py --config "$CONFIG" --run-dir "$OUT/harvest-hf-$regen" "${COMMON[@]}" "${HARVEST[@]}" \
      --set harvest.backend=hf --set "harvest.regenerate=$regen" >"$OUT/harvest-hf-$regen.json"
  done
  rm -rf "$OUT/harvest-sglang-true" "$OUT/harvest-sglang-false" "$OUT/harvest-sglang-one-request"
  local h=($PY data/harvest.py --config "$CONFIG" "${COMMON[@]}" "${HARVEST[@]}" --set harvest.backend=sglang)
  serve harvest "$OUT/serve-harvest" -- bash -c '
    "$@" --run-dir "'"$OUT"'/harvest-sglang-true" --set harvest.regenerate=true > "'"$OUT"'/harvest-sglang-true.json" &&
    "$@" --run-dir "'"$OUT"'/harvest-sglang-false" --set harvest.regenerate=false > "'"$OUT"'/harvest-sglang-false.json" &&
    { "$@" --run-dir "'"$OUT"'/harvest-sglang-one-request" --set harvest.regenerate=true --set harvest.sglang.capture=one_request \
        > "'"$OUT"'/harvest-sglang-one-request.json" 2> "'"$OUT"'/harvest-sglang-one-request.err" ||
      echo "one_request capture failed on the EAGLE3 server: see '"$OUT"'/harvest-sglang-one-request.err"; }' _ "${h[@]}"
  for regen in true false; do
    echo "== harvest, regenerate=$regen: embedded vs SGLang"
    $PY benchmarks/sglang_target.py compare-stores "$OUT/harvest-hf-$regen" "$OUT/harvest-sglang-$regen" --out "$OUT/compare-$regen.json" | tail -28
  done
  if [[ -d "$OUT/harvest-sglang-one-request/features" ]]; then
    echo "== one_request capture vs two_pass on the EAGLE3 server (final rows left out)"
    $PY benchmarks/sglang_target.py compare-stores "$OUT/harvest-sglang-true" "$OUT/harvest-sglang-one-request" --exclude-last --out "$OUT/compare-one-request.json" | tail -28
  fi
  python3 -c "import json,sys; [print(p, json.load(open(p))['this_run']) for p in sys.argv[1:]]" "$OUT"/harvest-*-true.json
}

bench() {
  local BENCH_SRC=${BENCH_MTBENCH:+, path: $BENCH_MTBENCH}
  BENCH_SRC=${BENCH_SRC:-$MTBENCH}
  rm -rf "$OUT/bench"
  $PY eval/bench/sglang_backend.py --config "$CONFIG" --run-dir "$OUT/bench" "${COMMON[@]}" \
    --set bench.backend=sglang --set bench.sglang.launch=true --set serve.max_servers=0 \
    --set "bench.prompts={kind: mtbench, limit: ${BENCH_PROMPTS:-8}$BENCH_SRC}" \
    --set "bench.max_new_tokens=${BENCH_TOKENS:-256}" --set bench.repetitions=3 --set serve.mem_fraction_static=0.2 \
    --set 'bench.settings=[{steps: 3, topk: 1, num_draft_tokens: 4}, {steps: 2, topk: 1, num_draft_tokens: 3}, {steps: 1, topk: 1, num_draft_tokens: 2}]' \
    --set 'bench.concurrency=[1, 8]'
}

case $STEP in
  probe) probe ;;
  harvest) harvest ;;
  bench) bench ;;
  all) probe && harvest && bench ;;
  *) echo "STEP: probe | harvest | bench | all" >&2; exit 2 ;;
esac
