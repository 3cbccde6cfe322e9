#!/usr/bin/env bash
# One `nvidia-h200` lease (one GPU, 16 host cores) for issue 14's live goals, over benchmarks/leases/run_phases.sh's phases,
# every bench interleaved per prompt (bench.interleave: prompt, new: the host's speed changes 1.5-2x for seconds at a
# time, RESULTS §19a) and its speed-up taken per repetition against that repetition's own plain pass (speedup_paired):
#   0. the GPU tests of the embedded decoder's CUDA paths (the graphed draft chain, its graphed extend, chain attention)
#   1. SGLang 0.5.17 servers on the GPU, one at a time, each with 0.1 of it and --sleep-on-idle: plain (:30100), then
#      EAGLE-3 with the shipped drafter at each of SGL_SETTINGS (the chain 7/1/8 and the trees 5/4/8, 7/4/16, 8/4/32:
#      offline, on §18c's answers, their walk is 2.80, 3.02, 3.53, 3.78; :30101 on); a setting whose server does not
#      come up is benched without; meanwhile the embedded bench's held-out features (calibrated_prediction.sh
#      STEPS=features)
#   2. SGLang: the calibration run on SGL_CAL_LIMIT (8) HumanEval prompts at SGL_NEW (512) new tokens, plain and every
#      setting (SGL_REPS (3) repetitions, batch 1, the shipped drafter); then the measurement on SGL_PER_CAT (2)
#      MT-Bench questions of each of its eight categories (16; §18c's first 8 were all writing), its economics
#      predicting each setting's tok/s and speed-up from the calibration's cycles and offline tau on this run's plain
#      answers (eval/offline/same_prompts.py): no speculative figure of this run is an input; then offline tau on each
#      speculative server's own answers (live against offline). The servers are stopped after it.
#   3. the embedded bench alone on the machine: benchmarks/leases/calibrated_prediction.sh with the shipped drafter as §18a
#      (bench.embedded.attention chain, the graphed chain; costs calibrated on EMB_CAL_PROMPTS (4) HumanEval prompts at EMB_CAL_NEW
#      (96) new tokens, tok/s predicted from offline tau on EMB_PROMPTS (4) MT-Bench prompts at EMB_NEW (384) and
#      measured there; EMB_SETTINGS 3/1/4,5/1/6,7/1/8, EMB_REPS 3)
# SGL_BENCH=0 leaves out 1-2: the embedded bench alone, once the GPU tests and its features are done.
# Usage as run_phases.sh (pack, stash, setup, wait): `bash benchmarks/leases/plans/sglang_live_trees.sh start` starts the plan. Keep a `wait`
# call in flight all the time: a machine with no call for 30 s is given back with the job on it (RESULTS §12, §13, §16b).
set -uo pipefail
cd "$(dirname "$0")/../../.."
: "${SGL_SETTINGS:=7/1/8,5/4/8,7/4/16,8/4/32}" "${SGL_NEW:=512}" "${SGL_CAL_LIMIT:=8}" "${SGL_PER_CAT:=2}"
source benchmarks/leases/plans/embedded_draft_graph.sh lib  # its phases (sgl_servers, sgl_run, sglang_phase, emb) over run_phases.sh's, with these settings
SGL_CAL_SRC="{kind: humaneval, path: $DATA/HumanEval.jsonl.gz, limit: $SGL_CAL_LIMIT}"  # plans/embedded_draft_graph.sh's sglang_phase
SGL_TEST_SRC="{kind: mtbench, path: $DATA/mtbench-questions.jsonl, per_category: $SGL_PER_CAT}"

s16() {
  local t
  gpu_tests
  local feats=$FEATS
  if [[ ${SGL_BENCH:-1} != 0 ]]; then
    say "1. SGLang servers: plain, then $SGL_SETTINGS with the shipped drafter, one at a time"
    wait_for 600 "$SGL_DIR/.ready"
    SGL+=(--set "serve.extra_args=[${SGL_SERVER_FLAGS---sleep-on-idle}]")
    t=$SECONDS
    sgl_servers > "$L/sgl-up.txt" 2>&1; cat "$L/sgl-up.txt"; echo "phase sgl_servers: $((SECONDS - t)) s"
  fi
  wait "$feats"; cat "$L/emb-features.txt"
  if [[ -f $L/.sgl-up ]]; then
    t=$SECONDS; sglang_phase; echo "phase sglang: $((SECONDS - t)) s"
  elif [[ ${SGL_BENCH:-1} != 0 ]]; then
    echo "no SGLang server came up: no SGLang bench"; xargs -r kill < "$L/sgl.pids" 2> /dev/null
  fi
  emb_phase "3. embedded, alone: the shipped drafter, calibrated on HumanEval, predicted and measured on MT-Bench"
}

case ${1:-} in
  lib) ;;
  run) shift; mkdir -p "$L" "$S"; s16; say done; touch "$L/.done-s16" ;;
  *) LEASE_SCRIPT=benchmarks/leases/plans/sglang_live_trees.sh exec bash benchmarks/leases/run_phases.sh "$@" ;;
esac
