#!/usr/bin/env bash
# What is left of issues 6 and 7, as one background job on one H200 lease: device calls then only carry files
# and wait (a call runs at most 10 minutes; the machine stays warm 30 s between calls).
#   bash benchmarks/leases/plans/real_run_2.sh start [PHASE...]   after `plans/real_run_2_setup.sh setup`: run the phases (default: all,
#                                                    in the order below) in a new process session, from a copy
#                                                    of this tree; the log is $L/log
#   bash benchmarks/leases/plans/real_run_2.sh wait SECS          wait up to SECS for the job; print the log's tail; pack the
#                                                    small results into $OUT/lease.tar.gz (and the general
#                                                    drafter's export into $OUT/export.tar.gz once it exists)
# Phases, in this order (a phase waits for the files it needs, which later calls may still be carrying):
#   harvest   three stores at once: general (ShareGPT train, MT-Bench's 60 non-code questions held out),
#             code (benchmarks/domain_sets.py: code ShareGPT train and held out, MT-Bench coding+math held out),
#             bench8 (the 8 bench prompts, held out, answers as long as the benches generate)
#   overhead  benchmarks/harvest_overhead.py in bf16 (the head variants and a profile at the first size), the general
#             store's bytes/token if it exists; with PREV=TREE, the same for an earlier commit's source tree (6.2)
#   train     the general drafter from scratch (6.3)
#   domain    offline tau of the general drafter on general, bench8 and code; the code fine-tune warm-started
#             from it, and a scratch drafter on the same code data and steps; offline tau after (6.3, 6.4)
#   bench     the embedded live bench at 3/1/4 against plain transformers decoding, on the bench8 prompts (6.3)
#   sglang    SGLang: plain against 3/1/4, 2/1/3, 1/1/2 at batch 1 and concurrency 8, interleaved (7.2)
#   speed     benchmarks/train_speed/train_speed.sh runs a and b: K2 dims, ours against SpecForge; each speed change (6.1)
# Env: L (results, /tmp/L), C (carried files, /tmp/c), MODEL (HF folder of the target, /tmp/smol-hf), DATA
# (sharegpt-3000.json), DOM (domain_sets.py's files), SGL_DIR; sizes for a CPU dry run: LIMIT, CODE_LIMIT,
# EPOCHS, FT_EPOCHS, NEW, BENCH_TOKENS, BENCH_REPS, OVERHEAD, PREV, DTYPE, ACCEL, ACCEL_ARGS, EXTRA (more --set pairs for every stage).
set -uo pipefail
cd "$(dirname "$0")/../../.."
L=${L:-/tmp/L}
C=${C:-/tmp/c}
MODEL=${MODEL:-/tmp/smol-hf}
DATA=${DATA:-$C/p2/data}
DOM=${DOM:-$DATA}
PY=${PYTHON:-python3}
ACCEL=${ACCEL:-configs/accelerate/1gpu.yaml}
CONFIG=configs/smollm2-135m.yaml
BENCH_TOKENS=${BENCH_TOKENS:-192}
BASE=(
  --set "target.path=$MODEL" --set target.gguf_file=null --set train.wandb_mode=disabled --set drafter.init=null
  --set harvest.max_turns=1 --set harvest.max_prompt_tokens=512 --set harvest.max_total_tokens=1024
  --set "harvest.max_new_tokens=${NEW:-384}" --set harvest.batch_size=192 --set harvest.shard_samples=256
  --set train.micro_batch_size=16 --set train.lr=2e-3 --set train.warmup_steps=40 --set train.save_every=400
  --set "bench.prompts={kind: mtbench, path: $DOM/mtbench-general.jsonl, limit: 8}"
)
read -r -a EXTRA_SETS <<< "${EXTRA:-}"
BASE+=("${EXTRA_SETS[@]}")
GENERAL=(--set "harvest.sources=[{kind: sharegpt, path: $DATA/sharegpt-3000.json, limit: ${LIMIT:-2800}, split: train}, {kind: mtbench, path: $DOM/mtbench-general.jsonl, split: heldout}]")
CODE=(--set "harvest.sources=[{kind: sharegpt, path: $DOM/code-train.json, limit: ${CODE_LIMIT:-1200}, split: train}, {kind: sharegpt, path: $DOM/code-heldout.json, split: heldout}, {kind: mtbench, path: $DOM/mtbench-codemath.jsonl, split: heldout}]")
BENCH8=(--set "harvest.sources=[{kind: mtbench, path: $DOM/mtbench-general.jsonl, limit: 8, split: heldout}]" --set "harvest.max_new_tokens=$BENCH_TOKENS")

need() {  # need FILE...: wait (at most 15 min) until each exists
  local f end=$((SECONDS + 900))
  for f; do
    until [[ -e $f ]]; do (( SECONDS < end )) || { echo "gave up waiting for $f"; return 1; }; sleep 3; done
  done
}
launch_train() {  # launch_train RUN PORT [sets...]: PORT for torch.distributed, one per concurrent launch
  accelerate launch --config_file "$ACCEL" ${ACCEL_ARGS:-} --main_process_port "$2" train/finetune.py --config $CONFIG --run-dir "$1" \
    --resume auto "${BASE[@]}" "${@:3}"
}
offline() {  # offline NAME FEATURES_RUN CHECKPOINT: offline tau of CHECKPOINT on FEATURES_RUN's held-out split
  mkdir -p "$L/eval-$1" && ln -sfn "$2/features" "$L/eval-$1/features"
  $PY eval/offline/accept_len.py --config $CONFIG --run-dir "$L/eval-$1" "${BASE[@]}" --set "eval.checkpoint=$3" > "$L/eval-$1.txt" 2>&1
  echo "-- offline tau, $1: $(grep -m1 "offline accept length" "$L/eval-$1.txt")"
  $PY -c "import json, sys; print({k: round(v['tau'], 3) for k, v in json.load(open(sys.argv[1]))['settings'].items()})" "$L/eval-$1/eval/accept_len.json"
}

speed() {
  need "$C/.whl-specforge" && OUT=$L/speed WHEELS=$C/.whl-specforge A_ARGS="--variant topk+adam=fused --variant topk+adam=fused+compile --theirs flex_attention" \
    bash benchmarks/train_speed/train_speed.sh
}
harvest() {
  need "$DATA/sharegpt-3000.json" "$DOM/code-train.json" || return 1
  local name
  $PY data/harvest.py --config $CONFIG --run-dir "$L/general" "${BASE[@]}" "${GENERAL[@]}" > "$L/harvest-general.json" 2> "$L/harvest-general.log" &
  $PY data/harvest.py --config $CONFIG --run-dir "$L/code" "${BASE[@]}" "${CODE[@]}" > "$L/harvest-code.json" 2> "$L/harvest-code.log" &
  $PY data/harvest.py --config $CONFIG --run-dir "$L/bench8" "${BASE[@]}" "${BENCH8[@]}" > "$L/harvest-bench8.json" 2> "$L/harvest-bench8.log" &
  wait
  for name in general code bench8; do echo "-- $name:"; tail -c 1500 "$L/harvest-$name.json"; echo; done
}
overhead() {  # with PREV (a source tree of an earlier commit), that tree's capture is measured the same way after ours
  local size extra feats=() sizes=(${OVERHEAD:-16x512 64x512 16x1024 64x1024})  # batch x sequence
  [[ -f $L/general/features/manifest.json ]] && feats=(--features "$L/general/features")
  for size in "${sizes[@]}"; do
    extra=() && [[ $size == "${sizes[0]}" ]] && extra=(--heads --profile "$L/profile")
    $PY benchmarks/harvest_overhead.py --config $CONFIG "${BASE[@]}" --set "target.dtype=${DTYPE:-bfloat16}" "${feats[@]}" \
      --mtbench "$DOM/mtbench-general.jsonl" --batch "${size%x*}" --seq "${size#*x}" --rounds 8 "${extra[@]}" \
      --out "$L/overhead-$size.json" | tail -3
  done
  [[ -n ${PREV:-} ]] || return 0
  $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/eagle3ft-prev "$PREV" >/dev/null || return 1
  for size in "${sizes[@]}"; do
    PYTHONPATH=/tmp/eagle3ft-prev:$PYTHONPATH $PY benchmarks/harvest_overhead.py --config $CONFIG "${BASE[@]}" \
      --set "target.dtype=${DTYPE:-bfloat16}" --mtbench "$DOM/mtbench-general.jsonl" --batch "${size%x*}" --seq "${size#*x}" \
      --rounds 8 --out "$L/overhead-prev-$size.json" | tail -1
  done
}
train() {
  launch_train "$L/general" 29510 "${GENERAL[@]}" --set "train.epochs=${EPOCHS:-5}" > "$L/train-general.log" 2>&1
  tail -5 "$L/train-general.log"
}
domain() {
  local G=$L/general/export
  mkdir -p "$L/code-scratch" && ln -sfn "$L/code/features" "$L/code-scratch/features" && cp "$L/code/vocab.safetensors" "$L/code-scratch/"
  offline general-before "$L/general" "$G" &
  offline bench8 "$L/bench8" "$G" &
  offline code-before "$L/code" "$G" &
  launch_train "$L/code" 29520 "${CODE[@]}" --set "drafter.init=$G" --set "train.epochs=${FT_EPOCHS:-3}" --set train.lr=5e-4 --set train.warmup_steps=10 \
    > "$L/train-code.log" 2>&1 &
  launch_train "$L/code-scratch" 29530 "${CODE[@]}" --set "train.epochs=${FT_EPOCHS:-3}" --set train.warmup_steps=10 > "$L/train-code-scratch.log" 2>&1 &
  wait
  tail -n 3 "$L/train-code.log" "$L/train-code-scratch.log"
  offline code-after "$L/code" "$L/code/export" &
  offline general-after "$L/general" "$L/code/export" &
  offline code-scratch "$L/code" "$L/code-scratch/export" &
  wait
}
bench() {  # the embedded decoder on the bench8 prompts; economics with the offline tau of the same prompts
  rm -rf "$L/bench-embedded" && mkdir -p "$L/bench-embedded/eval"
  cp "$L/eval-bench8/eval/accept_len.json" "$L/bench-embedded/eval/"
  $PY eval/bench/live.py --config $CONFIG --run-dir "$L/bench-embedded" "${BASE[@]}" --set "eval.checkpoint=$L/general/export" \
    --set "bench.max_new_tokens=$BENCH_TOKENS" --set "bench.repetitions=${BENCH_REPS:-3}" --set 'bench.settings=[{steps: 3, topk: 1, num_draft_tokens: 4}]' \
    > "$L/bench-embedded.txt" 2>&1
  tail -12 "$L/bench-embedded.txt"
}
sglang() {
  need "${SGL_DIR:-/tmp/sgl}/.ready" || return 1
  SGL_DIR=${SGL_DIR:-/tmp/sgl} BENCH_MTBENCH=$DOM/mtbench-general.jsonl BENCH_TOKENS=$BENCH_TOKENS PYTHON=$PY \
    bash benchmarks/leases/sglang_vs_embedded.sh bench "$MODEL" "$L/general/export" "$L/sgl" > "$L/sglang-bench.txt" 2>&1
  mkdir -p "$L/sgl/bench/eval" && cp "$L/eval-bench8/eval/accept_len.json" "$L/sgl/bench/eval/"
  $PY eval/economics/analysis.py --config $CONFIG --run-dir "$L/sgl/bench" > "$L/sglang-economics.txt" 2>&1
  tail -25 "$L/sglang-bench.txt"; cat "$L/sglang-economics.txt"
}

run_all() {
  local phases=("$@") p t
  [[ ${#phases[@]} -gt 0 ]] || phases=(harvest overhead train domain bench sglang speed)
  for p in "${phases[@]}"; do
    t=$SECONDS
    echo "== $p: start $(date -u +%T)"
    "$p"
    echo "== $p: end, exit $?, $((SECONDS - t)) s"
  done
  touch "$L/done"
}
pack() {
  [[ -n ${OUT:-} ]] || return 0
  tar czf "$OUT/lease.tar.gz" -C "$L" --exclude=features --exclude=ckpt --exclude='*.safetensors' --exclude=export \
    --exclude='*.partial' . 2>/dev/null
  [[ -f $L/general/export/config.json ]] && tar czf "$OUT/export.tar.gz" -C "$L/general" export
  ls -la "$OUT"
}

case ${1:-} in
  start)
    shift
    [[ -e $L/log ]] && { echo "a job already ran or runs in $L (log: $L/log)" >&2; exit 2; }
    mkdir -p "$L" && rm -rf /tmp/lease-src && mkdir -p /tmp/lease-src
    tar cf - --exclude=./.git --exclude=./.carry --exclude=./.whl-specforge --exclude=./.venv --exclude=./runs . | tar xf - -C /tmp/lease-src
    L=$L C=$C MODEL=$MODEL DATA=$DATA DOM=$DOM setsid nohup bash /tmp/lease-src/benchmarks/leases/plans/real_run_2.sh run "$@" > "$L/log" 2>&1 < /dev/null &
    echo "started: log $L/log" ;;
  run) shift; mkdir -p "$L"; run_all "$@" ;;
  wait)
    end=$((SECONDS + ${2:-540}))
    while [[ ! -f $L/done ]] && (( SECONDS < end )); do sleep 5; done
    [[ -f $L/done ]] && echo "job done" || echo "job still running"
    tail -n "${TAIL:-80}" "$L/log"
    pack ;;
  *) echo "usage: $0 start [PHASE...] | wait SECS" >&2; exit 2 ;;
esac
