#!/usr/bin/env bash
# One `nvidia-h200` lease (one GPU, 16 host cores) for issues 14 and 13, over benchmarks/leases/run_phases.sh's phases:
#   1. the embedded bench alone on the GPU (nothing else running: RESULTS §10f, §13c were noisy beside other work):
#      benchmarks/leases/calibrated_prediction.sh with the shipped drafter, its costs calibrated on EMB_CAL_PROMPTS (4)
#      HumanEval prompts at EMB_CAL_NEW (96) new tokens, then its tok/s predicted from its offline tau on EMB_PROMPTS
#      (4) MT-Bench prompts at EMB_NEW (384) new tokens, then measured there (EMB_SETTINGS, EMB_REPS), with the
#      target's attention EMB_ATTENTION (sdpa; chain: eval/decode/chain_attention.py).
#   2. regeneration of §14a's workload (all of ShareGPT + CHITCHAT (3000) chitchat conversations, MT-Bench held out,
#      T=0, then HumanEval) through PER_GPU (3) plain servers that run RUNNING (2048) requests at once on the GPU
#      (§14a, §16a: 1024), with SERVER_EXTRA (--min-free-slots-delay 4: new prefills wait for 4 free slots, so they
#      go in batches); the client keeps SETTING (1024x1) requests in flight per server.
#   3. on the same servers, their prefix caches flushed, the same workload at SETTING_A (341x1): at most 341 requests
#      running per server, as in §14a and §16a, the A side of 2's batch size on the same machine.
# Usage as run_phases.sh (pack, stash, setup, wait): `bash benchmarks/leases/plans/regen_2048_running.sh start` starts the plan. Keep a `wait`
# call in flight all the time: a machine with no call for 30 s is given back with the job on it (RESULTS §12, §13, §16b).
set -uo pipefail
cd "$(dirname "$0")/../../.."
: "${CHITCHAT:=3000}" "${REGEN_S:=420}" "${SETTING:=1024x1}" "${PER_GPU:=3}" "${RUNNING:=2048}"
: "${SERVER_EXTRA=--min-free-slots-delay 4}"
export CHITCHAT REGEN_S SETTING PER_GPU RUNNING SERVER_EXTRA
source benchmarks/leases/run_phases.sh lib

embedded_alone() {
  say "1. embedded: the shipped drafter, calibrated on HumanEval, predicted and measured on MT-Bench"
  local t=$SECONDS
  CUDA_VISIBLE_DEVICES=0 EXTRA="${BASE[*]} --set bench.embedded.attention=${EMB_ATTENTION:-sdpa}" NEW=${EMB_NEW:-384} CAL_NEW=${EMB_CAL_NEW:-96} REPS=${EMB_REPS:-3} \
    N_PROMPTS=${EMB_PROMPTS:-4} SETTINGS=${EMB_SETTINGS:-3/1/4,5/1/6} PY=$PY MTBENCH=$DATA/mtbench-questions.jsonl \
    CAL_SOURCE="kind: humaneval, path: $DATA/HumanEval.jsonl.gz, limit: ${EMB_CAL_PROMPTS:-4}" \
    timeout 900 bash benchmarks/leases/calibrated_prediction.sh "$S/pred" "$SHIPPED" "$SHIPPED" >> "$L/embedded.txt" 2>&1
  echo "exit $?"; tail -32 "$L/embedded.txt"
  pred_back
  echo "phase embedded: $((SECONDS - t)) s"
}

flush() {  # every server's prefix cache, so that the next pass computes its prompts again
  local u
  for u in "${URLS[@]}"; do curl -sf -X POST "$u/flush_cache" > /dev/null || curl -sf "$u/flush_cache" > /dev/null; done
}

s14() {
  local t n
  wait_for 600 "$MODEL/config.json"
  embedded_alone
  wait_for 600 "$SGL_DIR/.ready"
  ulimit -n "$(ulimit -Hn)" 2> /dev/null  # SETTING's connections: 1024 per server, client and server side
  say "2. regen: $PER_GPU servers, $RUNNING running on the GPU ($SERVER_EXTRA), $SETTING per server"
  mkdir -p "$S"
  t=$SECONDS
  NGPU=1 servers_up || { servers_down; return 1; }
  echo "phase servers_up: $((SECONDS - t)) s"
  grep -h "max_running_requests=\|capture_bs\|Capture cuda graph bs" "$L/server0.log" | tail -2 | cut -c1-400
  regen_stores
  for n in "$L"/server[0-9].log; do cp "$n" "${n%.log}.b.log"; done  # pass A logs on into the same files
  say "3. regen, the A side: the same workload at ${SETTING_A:-341x1} per server, caches flushed"
  flush
  t=$SECONDS
  SETTING=${SETTING_A:-341x1} regen_run "$S/main-a" "$(main_sources)" > "$L/regen-main-a.json" 2> "$L/regen-main-a.log"
  echo "exit $?; phase regen-main-a: $((SECONDS - t)) s"; tail -c 1200 "$L/regen-main-a.json"
  gen_throughput > "$L/gen-throughput-both.txt"
  servers_down
  for n in "$L"/server[0-9].log; do grep -h "Decode batch\|Prefill batch" "$n" | gzip > "${n%.log}.batch-lines.txt.gz"; done
}

case ${1:-} in
  run) shift; mkdir -p "$L" "$S"; s14; say done; touch "$L/.done-s14" ;;
  *) LEASE_SCRIPT=benchmarks/leases/plans/regen_2048_running.sh exec bash benchmarks/leases/run_phases.sh "$@" ;;
esac
