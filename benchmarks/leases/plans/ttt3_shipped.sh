#!/usr/bin/env bash
# One `nvidia-h200` lease (one GPU, 16 host cores) for issues 13 and 14, over benchmarks/leases/run_phases.sh's phases:
#   1. regen: all of ShareGPT + CHITCHAT chitchat conversations (MT-Bench held out), PER_GPU (3) plain SGLang servers
#      on the one GPU, started one at a time. RESULTS §13d ran two per GPU: 42.3 k answer tokens/s per H200.
#   2. RUNS=ttt3 (§9b's recipe with train.ttt_steps=3) on §9's carried token store, the data of the shipped drafter;
#      §12a trained it but lost its per-setting tau. Once its first steps are logged, `sglpred`'s plain server and its
#      calibration server (the shipped drafter) start beside it.
#   3. Offline tau (every root and the cycle walk) of TTT 3's best export and of the shipped drafter, on the held-out
#      features of the carried store; meanwhile the third server (TTT 3) starts.
#   4. `sglpred` with the host to itself (§13b ran the embedded bench beside it): the shipped drafter's run calibrates
#      the 3/1/4 cycle, TTT 3's tok/s is predicted from its offline tau on that run's plain answers, then measured. If
#      training left no export, the test drafter is $C/cal-demo-s5.
# Usage as run_phases.sh (stash, setup, wait): `bash benchmarks/leases/plans/ttt3_shipped.sh start` starts the plan.
set -uo pipefail
cd "$(dirname "$0")/../../.."
RUNS=${RUNS:-ttt3}
: "${EPOCHS:=3}" "${TRAIN_S:=480}" "${EVAL_EVERY:=200}" "${CHITCHAT:=3000}" "${REGEN_S:=300}" "${SGL_LONG:=512}"
export EPOCHS TRAIN_S EVAL_EVERY CHITCHAT REGEN_S SGL_LONG  # §9b's recipe, §13's sets
source benchmarks/leases/run_phases.sh lib

s11() {
  local name=${NAMES%% *} test
  wait_for 1200 "$SGL_DIR/.ready"
  say "1. regen, ${PER_GPU:-3} servers on one GPU: ShareGPT (all) + chitchat (${CHITCHAT:-2000})"
  mkdir -p "$S/regen"
  S=$S/regen PER_GPU=${PER_GPU:-3} NGPU=1 TOKENS='' regen

  say "2. $name on the carried token store; SGLang's plain and calibration servers start once it has logged steps"
  TOKENS=$C/tok regen
  HELD_GPU=0 heldout > "$L/heldout.txt" 2>&1
  ( wait_for 900 "$S/$name/train/metrics.jsonl"
    sglpred_serve 30100 0 && sglpred_serve 30101 1 "$SHIPPED" && touch "$L/.sgl-cal-up" ) > "$L/sgl-up.txt" 2>&1 &
  local up=$!
  train

  say "3. offline tau of $name and of the shipped drafter; the test server starts"
  test=$S/$name/export-best
  [[ -f $test/config.json ]] || test=$C/cal-demo-s5
  wait "$up"; cat "$L/sgl-up.txt"
  local serve3=
  if [[ -f $L/.sgl-cal-up ]]; then sglpred_serve 30102 2 "$test" >> "$L/sgl-up.txt" 2>&1 & serve3=$!; fi
  mkdir -p "$S/shipped" && ln -sfn "$SHIPPED" "$S/shipped/export-best"
  NAMES="$NAMES shipped" EVAL_GPU=0 evaluate
  [[ -n $serve3 ]] && wait "$serve3"; tail -1 "$L/sgl-up.txt"

  say "4. SGLang calibrated prediction, the host to itself: calibrate with the shipped drafter, predict $test"
  if curl -sf http://127.0.0.1:30102/health > /dev/null; then
    sglpred_bench "$test" > "$L/sglpred.txt" 2>&1; cat "$L/sglpred.txt"
  else
    echo "the SGLang servers are not all up: no prediction"; xargs -r kill < "$L/sgl.pids" 2> /dev/null
  fi
}

case ${1:-} in
  run) shift; mkdir -p "$L" "$S"; s11; say done; touch "$L/.done-s11" ;;
  *) LEASE_SCRIPT=benchmarks/leases/plans/ttt3_shipped.sh exec bash benchmarks/leases/run_phases.sh "$@" ;;
esac
