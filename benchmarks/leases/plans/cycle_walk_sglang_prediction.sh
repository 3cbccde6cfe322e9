#!/usr/bin/env bash
# One `nvidia-h200-x2` lease for issues 13 and 14, over benchmarks/leases/run_phases.sh's phases:
#   0. (HELD=1) the held-out features of the carried token store (§9's) on GPU 1, and the shipped drafter's offline
#      tau on them, every root and the cycle walk.
#   1. GPU 0: `sglpred` (SGLang, 3/1/4): CAL calibrates, the shipped drafter's tok/s is predicted from its offline tau
#      on the calibration's plain answers, then measured. Beside it, GPU 1: the embedded calibrated prediction
#      (calibrate with CAL, predict and measure the shipped drafter, EMB_* sizes). The x2 host has 32 cores; both
#      benches are batch 1 and sensitive to a busy host (RESULTS §12c), so nothing else runs meanwhile.
#   2. regen: all of ShareGPT + CHITCHAT chitchat conversations (MT-Bench held out), PER_GPU (2) plain SGLang servers
#      per GPU on both GPUs: §9a's store and client, with two servers per GPU instead of one.
# Usage as run_phases.sh (stash, setup, wait): `bash benchmarks/leases/plans/cycle_walk_sglang_prediction.sh start` starts the plan.
# Carried beyond run_phases.sh's pieces: $C/cal-demo-s5 (CAL: any SmolLM2 drafter other than the one measured;
# its tau does not matter, only its costs) and $C/d/chitchat.json.gz.
set -uo pipefail
cd "$(dirname "$0")/../../.."
source benchmarks/leases/run_phases.sh lib
CAL=${CAL:-$C/cal-demo-s5}

s10() {
  wait_for 1200 "$SGL_DIR/.ready"
  if [[ ${HELD:-1} == 1 ]]; then
    TOKENS=$C/tok regen  # the held-out sets of §9's store, on which the shipped drafter was measured
    say "0. held-out offline tau of the shipped drafter on GPU 1"
    HELD_GPU=1 heldout > "$L/heldout.txt" 2>&1
    mkdir -p "$S/shipped" && ln -sfn "$SHIPPED" "$S/shipped/export-best"
    for set in mtbench humaneval; do eval_one shipped "$set" export-best 1 & done
    wait
  fi

  say "1. SGLang calibrated prediction on GPU 0; the embedded one on GPU 1"
  SGL_GPU=0 sglpred "$CAL" "$SHIPPED" > "$L/sglpred.txt" 2>&1 &
  local sgl=$!
  EMB_GPU=1 embedded_step all "$CAL" "$SHIPPED"
  wait "$sgl"; cat "$L/sglpred.txt"

  say "2. regen, ${PER_GPU:-2} servers per GPU: ShareGPT (all) + chitchat (${CHITCHAT:-2000})"
  mkdir -p "$S/regen"
  S=$S/regen PER_GPU=${PER_GPU:-2} TOKENS='' regen
}

case ${1:-} in
  run) shift; mkdir -p "$L" "$S"; s10; say done; touch "$L/.done-s10" ;;
  *) LEASE_SCRIPT=benchmarks/leases/plans/cycle_walk_sglang_prediction.sh exec bash benchmarks/leases/run_phases.sh "$@" ;;
esac
