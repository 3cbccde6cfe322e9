#!/usr/bin/env bash
# One `nvidia-h200` lease (one GPU, 16 host cores) for issue 14's last goal: tok/s predicted within 10% at every
# setting, embedded and in SGLang, from costs calibrated in an earlier run. What changed since §19 (plans/sglang_live_trees.sh):
#   - each calibration runs on prompts of the measurement's own kind and length, disjoint from them (`skip`, new), not
#     on short HumanEval answers: embedded, MT-Bench questions 5-8 at 384 new tokens against questions 1-4 (§18b's
#     calibrated cycle cost 12-29% fewer plain steps on 96-token HumanEval answers than on MT-Bench); SGLang, the third
#     and fourth MT-Bench question of each category against the first and second (§19b's HumanEval calibration
#     ran a 1.92 ms plain step against the measurement's 1.64 ms)
#   - the embedded bench in float32 (EMB_DTYPE): plain and speculative decoding then choose the same tokens, so the
#     prediction's tau input (the walk on the plain answers) is the tau the live decoder meets (§18b: in bf16 the
#     speculative answers parted from the plain ones and their tau was 5-11% higher)
#   - every economics prints the host's own drift: the plain tok/s of the calibration against the measurement's
#   - the SGLang servers start staggered (each once the one before has its KV pools) without prefill CUDA graphs and
#     with decode graphs up to batch 8 (the benches run batch 1; §19b: five servers took 472 s, 65 s of it the
#     plain server's prefill graphs)
# The plan:
#   1. the embedded bench alone on the machine: benchmarks/leases/calibrated_prediction.sh with the shipped drafter (chain
#      attention, the graphed chain), EMB_SETTINGS (3/1/4,5/1/6,7/1/8), EMB_REPS (3), interleaved per prompt
#   2. SGLang 0.5.17: plain (:30100) and EAGLE-3 with the shipped drafter at SGL_SETTINGS (7/1/8,7/4/16,8/4/32: §19b's
#      chain and its two best trees), each with 0.1 of the GPU and --sleep-on-idle; the calibration, then the
#      measurement at SGL_NEW (512) new tokens, batch 1, SGL_REPS (3) repetitions interleaved per prompt, its economics
#      from the calibration's cycles and offline tau on the measurement's plain answers; then offline tau on each
#      speculative server's own answers
# SGL_BENCH=0 leaves out 2, EMB_BENCH=0 leaves out 1. More prompts narrow the offline tau's interval (RESULTS §20c):
# SGL_PER_CAT=5 benches 40 MT-Bench questions, calibrated on 40 others (then SGL_RUN_TIMEOUT=900, each run's limit);
# SGL_CAL_PER_CAT=2 calibrates on 16 of those others (the cycle costs, unlike tau, moved 1-3% between runs in §20b).
# SGL_RECAL=1 runs the calibration's prompts again after the measurement (3c: the host's own drift over the lease,
# on the same prompts); SGL_TEST_WARMUP=first warms the measurement's servers with one prompt, not all (the
# calibration has warmed them). SGL_TEST_SKIP=7 measures on each category's 8th question on (answers no earlier lease
# decoded: the servers' answers repeat from lease to lease, RESULTS §22); SGL_CAL_POOL (calibration.json files, comma-
# separated) predicts once more with the cycles pooled over them and 3a (3d, bench.calibration_pool).
# Usage as run_phases.sh (pack, stash, setup, wait): `bash benchmarks/leases/plans/tok_s_prediction.sh start`
# starts the plan. Keep a `wait` call in flight all the time: a machine with no call for 30 s is given back with the
# job on it (RESULTS §12, §13, §16b).
set -uo pipefail
cd "$(dirname "$0")/../../.."
: "${SGL_SETTINGS:=7/1/8,7/4/16,8/4/32}" "${SGL_NEW:=512}" "${SGL_PER_CAT:=2}"
source benchmarks/leases/plans/embedded_draft_graph.sh lib  # its phases (sgl_servers, sgl_run, sglang_phase, emb) over run_phases.sh's
SGL_CAL_SRC="{kind: mtbench, path: $DATA/mtbench-questions.jsonl, per_category: ${SGL_CAL_PER_CAT:-$SGL_PER_CAT}, skip: $SGL_PER_CAT}"
SGL_TEST_SRC="{kind: mtbench, path: $DATA/mtbench-questions.jsonl, per_category: $SGL_PER_CAT, skip: ${SGL_TEST_SKIP:-0}}"
: "${EMB_PROMPTS:=4}" "${EMB_NEW:=384}"
EMB_CAL_SOURCE=${EMB_CAL_SOURCE:-"kind: mtbench, path: $DATA/mtbench-questions.jsonl, limit: $EMB_PROMPTS, skip: $EMB_PROMPTS"}
EMB_CAL_NEW=${EMB_CAL_NEW:-$EMB_NEW} EMB_EXTRA="--set target.dtype=${EMB_DTYPE:-float32} ${EMB_EXTRA:-}"
EMB_DRAFTING=${EMB_DRAFTING:-auto}  # the graphed chain passed its GPU tests in §18 and §19

s17() {
  local t
  wait_for 600 "$MODEL/config.json"
  if [[ ${EMB_BENCH:-1} != 0 ]]; then
    say "0. the embedded bench's held-out features"
    t=$SECONDS; emb features; echo "features exit $? in $((SECONDS - t)) s"
    emb_phase "1. embedded, alone, in ${EMB_DTYPE:-float32}: calibrated on $EMB_CAL_SOURCE, predicted and measured on MT-Bench"
  fi
  [[ ${SGL_BENCH:-1} != 0 ]] || return 0
  say "2. SGLang servers: plain, then $SGL_SETTINGS with the shipped drafter, staggered"
  wait_for 600 "$SGL_DIR/.ready"
  SGL+=(--set "serve.extra_args=[${SGL_SERVER_FLAGS-"--sleep-on-idle, --cuda-graph-max-bs-decode, '8', --cuda-graph-backend-prefill, disabled"}]")
  t=$SECONDS
  SGL_STAGGER=${SGL_STAGGER:-1} sgl_servers > "$L/sgl-up.txt" 2>&1; cat "$L/sgl-up.txt"; echo "phase sgl_servers: $((SECONDS - t)) s"
  if [[ -f $L/.sgl-up ]]; then
    t=$SECONDS; sglang_phase; echo "phase sglang: $((SECONDS - t)) s"
  else
    echo "no SGLang server came up: no SGLang bench"; xargs -r kill < "$L/sgl.pids" 2> /dev/null
  fi
}

case ${1:-} in
  lib) ;;
  run) shift; mkdir -p "$L" "$S"; s17; say done; touch "$L/.done-s17" ;;
  *) LEASE_SCRIPT=benchmarks/leases/plans/tok_s_prediction.sh exec bash benchmarks/leases/run_phases.sh "$@" ;;
esac
