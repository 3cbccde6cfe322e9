#!/usr/bin/env bash
# One `nvidia-h200` lease (one GPU, 16 host cores) for issue 14's live goals, over benchmarks/leases/run_phases.sh's phases:
#   0. the GPU tests of the embedded decoder's CUDA paths: the graphed draft chain (eval/decode/draft_graph.py) and chain
#      attention; meanwhile the embedded bench's held-out features (calibrated_prediction.sh STEPS=features)
#   1. SGLang 0.5.17 servers on the GPU, one at a time, each with 0.1 of it and --sleep-on-idle (an idle scheduler
#      otherwise spins a host core): plain (:30100), then EAGLE-3 with the shipped drafter at each of SGL_SETTINGS
#      (2/1/3,3/1/4,5/1/6; :30101 on)
#   2. the embedded bench with the servers idle: benchmarks/leases/calibrated_prediction.sh with the shipped drafter,
#      bench.embedded.attention EMB_ATTENTION (chain) and bench.embedded.drafting (auto: the graphed chain), its costs calibrated on
#      EMB_CAL_PROMPTS (4) HumanEval prompts at EMB_CAL_NEW (96) new tokens, its tok/s predicted from offline tau on
#      EMB_PROMPTS (4) MT-Bench prompts at EMB_NEW (384) and measured there (EMB_SETTINGS 3/1/4,5/1/6,7/1/8, EMB_REPS 3)
#   3. SGLang: the calibration run on SGL_LIMIT (8) HumanEval prompts at SGL_NEW (512) new tokens, plain and every
#      setting interleaved (SGL_REPS (3) repetitions, batch 1, the shipped drafter); then the measurement on SGL_LIMIT MT-Bench
#      prompts at SGL_NEW, its economics predicting each setting's tok/s from the calibration's cycles and offline tau
#      on this run's plain answers (eval/offline/same_prompts.py) -- no speculative figure of this run is an input -- and
#      the setting it picks; then offline tau on each speculative server's own answers (live against offline)
#   4. an A side of 2: the same prompts and sizes at EMB_AB_SETTING (5/1/6) with EMB_AB_SET (bench.embedded.drafting=eager: a
#      drafter forward at a time, as in RESULTS §17b; bench.embedded.draft_graph_extend=true: the extends graphed too), plain
#      interleaved (EMB_AB=0 leaves it out)
# Usage as run_phases.sh (pack, stash, setup, wait): `bash benchmarks/leases/plans/embedded_draft_graph.sh start` starts the plan. Keep a `wait`
# call in flight all the time: a machine with no call for 30 s is given back with the job on it (RESULTS §12, §13, §16b).
set -uo pipefail
cd "$(dirname "$0")/../../.."
source benchmarks/leases/run_phases.sh lib
: "${SGL_SETTINGS:=2/1/3,3/1/4,5/1/6}" "${SGL_NEW:=512}" "${SGL_LIMIT:=8}"
IFS=, read -r -a SGL_LIST <<< "$SGL_SETTINGS"

settings_yaml() {  # settings_yaml 3/1/4,5/1/6 -> [{steps: 3, topk: 1, num_draft_tokens: 4}, ...]
  local s out="" st tk nd
  IFS=, read -r -a s <<< "$1"
  for x in "${s[@]}"; do IFS=/ read -r st tk nd <<< "$x"; out+="${out:+, }{steps: $st, topk: $tk, num_draft_tokens: $nd}"; done
  echo "[$out]"
}
emb() {  # emb STEPS: benchmarks/leases/calibrated_prediction.sh's STEPS with this plan's sizes
  CUDA_VISIBLE_DEVICES=0 STEPS=$1 EXTRA="${BASE[*]} --set bench.embedded.attention=${EMB_ATTENTION:-chain} --set bench.embedded.drafting=$EMB_DRAFTING ${EMB_EXTRA:-}" \
    NEW=${EMB_NEW:-384} \
    CAL_NEW=${EMB_CAL_NEW:-96} REPS=${EMB_REPS:-3} N_PROMPTS=${EMB_PROMPTS:-4} SETTINGS=${EMB_SETTINGS:-3/1/4,5/1/6,7/1/8} \
    PY=$PY MTBENCH=$DATA/mtbench-questions.jsonl \
    CAL_SOURCE=${EMB_CAL_SOURCE:-"kind: humaneval, path: $DATA/HumanEval.jsonl.gz, limit: ${EMB_CAL_PROMPTS:-4}"} \
    timeout 900 bash benchmarks/leases/calibrated_prediction.sh "$S/pred" "$SHIPPED" "$SHIPPED" >> "$L/embedded.txt" 2>&1
}
sgl_servers() {  # phase 1: plain on :30100, then one EAGLE-3 server per SGL_SETTINGS entry, each up before the next
                 # starts (SGL_STAGGER=1: each starts once the one before has its KV pools, sgl_placed); SGL_LIST,
                 # SGL_SETTINGS and SGL_PORTS keep the settings whose server came up, and their ports (sgl_run's)
  local slot=0 s port up=() ports=()
  if [[ ${SGL_STAGGER:-0} == 1 ]]; then
    MEMF=$(mem_fraction 0.1 0) sgl_serve 30100 0 --role baseline; sgl_placed 30100 1
  else
    sglpred_serve 30100 0 || return 1
  fi
  for s in "${SGL_LIST[@]}"; do
    slot=$((slot + 1)); port=$((30100 + slot))
    MEMF=$(mem_fraction 0.1 "$slot") sgl_serve "$port" 0 --role speculative --drafter "$SHIPPED" --setting "$s"
    if [[ ${SGL_STAGGER:-0} == 1 ]]; then sgl_placed "$port" 2; continue; fi  # two pools: the target's, the drafter's
    sgl_keep "$port" "$s" || { wait "${SGL_PIDS[port]}" 2> /dev/null; slot=$((slot - 1)); }  # ~85 s each (§19b)
  done
  if [[ ${SGL_STAGGER:-0} == 1 ]]; then
    SGL_WAIT_S=600 sgl_wait 30100 || { xargs -r kill < "$L/sgl.pids"; return 1; }
    echo "SGLang :30100 up (plain)"
    for ((slot = 1; slot <= ${#SGL_LIST[@]}; slot++)); do sgl_keep $((30100 + slot)) "${SGL_LIST[slot - 1]}"; done
  fi
  (( ${#up[@]} )) || return 1
  SGL_LIST=("${up[@]}") SGL_PORTS=("${ports[@]}"); SGL_SETTINGS=$(IFS=,; echo "${up[*]}")
  touch "$L/.sgl-up"
}
sgl_keep() {  # sgl_keep PORT SETTING: sgl_servers' server on PORT, healthy within 5 min, joins its up and ports; one
              # that does not is stopped and benched without
  if SGL_WAIT_S=300 sgl_wait "$1"; then up+=("$2"); ports+=("$1"); echo "SGLang :$1 up ($2)"; return 0; fi
  echo "SGLang :$1 ($2) did not come up: benched without it"; kill "${SGL_PIDS[$1]}" 2> /dev/null; return 1
}
sgl_placed() {  # sgl_placed PORT POOLS: the server on PORT has logged POOLS KV pools ("Memory pool end"), is up, has
                # exited, or 5 min passed: the next server on the GPU may start (mem_fraction; RESULTS §13)
  local end=$((SECONDS + 300))
  until (( $(cat "$L"/*-"$1".log 2> /dev/null | grep -c "Memory pool end") >= $2 )) \
      || curl -sf "http://127.0.0.1:$1/health" > /dev/null; do
    (( SECONDS < end )) && kill -0 "${SGL_PIDS[$1]:-0}" 2> /dev/null || return 0  # sgl_wait reports it
    sleep 1
  done
}
sgl_run() {  # sgl_run RUN SRC [sets...]: plain (:30100) against every setting's server, interleaved, 3 repetitions
  local run=$1 src=$2 urls="" i; shift 2
  for i in "${SGL_PORTS[@]}"; do urls+="${urls:+, }http://127.0.0.1:$i"; done
  timeout "${SGL_RUN_TIMEOUT:-420}" $PY eval/bench/sglang_backend.py --config $CONFIG --run-dir "$run" "${SGL[@]}" --set bench.backend=sglang \
    --set bench.sglang.baseline_url=http://127.0.0.1:30100 --set "bench.sglang.speculative_urls=[$urls]" \
    --set "bench.prompts=$src" --set "bench.max_new_tokens=$SGL_NEW" --set "bench.repetitions=${SGL_REPS:-3}" \
    --set "bench.settings=$(settings_yaml "$SGL_SETTINGS")" --set 'bench.concurrency=[1]' --set 'bench.drafters={}' \
    "$@" > "$run.txt" 2>&1
  echo "exit $?"; tail -14 "$run.txt"
}
sglang_phase() {  # the calibration on SGL_CAL_SRC (SGL_LIMIT HumanEval prompts), the measurement on SGL_TEST_SRC (SGL_LIMIT
                  # MT-Bench prompts)
  local cal=$S/sgl-cal test=$S/sgl-test s
  local cal_src=${SGL_CAL_SRC:-"{kind: humaneval, path: $DATA/HumanEval.jsonl.gz, limit: $SGL_LIMIT}"}
  local test_src=${SGL_TEST_SRC:-"{kind: mtbench, path: $DATA/mtbench-questions.jsonl, limit: $SGL_LIMIT}"}
  export CUDA_VISIBLE_DEVICES=0  # the benches' in-process target (offline tau on the same prompts)
  say "3a. SGLang calibration: $cal_src, $SGL_NEW new tokens, plain and $SGL_SETTINGS"
  sgl_run "$cal" "$cal_src"
  say "3b. SGLang measurement: $test_src, predicted from 3a's cycles and offline tau on the plain answers"
  sgl_run "$test" "$test_src" --set "bench.calibration=$cal/bench/calibration.json" --set "bench.warmup=${SGL_TEST_WARMUP:-all}"
  if [[ ${SGL_RECAL:-0} == 1 ]]; then  # the calibration's prompts again: how far the host moved over the lease
    say "3c. SGLang calibration again, after the measurement: $cal_src"
    sgl_run "$S/sgl-cal2" "$cal_src" --set "bench.calibration=$cal/bench/calibration.json" --set bench.warmup=first
  fi
  $PY eval/offline/same_prompts.py --config $CONFIG --run-dir "$test" "${SGL[@]}" --answers-from "$test" \
    --set "bench.prompts=$test_src" \
    --set "bench.max_new_tokens=$SGL_NEW" --set "bench.settings=$(settings_yaml "$SGL_SETTINGS")" 2>&1 | tail -1
  $PY eval/economics/analysis.py --config $CONFIG --run-dir "$test" "${SGL[@]}" --set "bench.calibration=$cal/bench/calibration.json" \
    --set "bench.settings=$(settings_yaml "$SGL_SETTINGS")" 2>&1 | tail -8
  if [[ -n ${SGL_CAL_POOL:-} ]]; then  # the same prediction with the cycles pooled over earlier runs' calibrations
    say "3d. the prediction again, its cycles in plain steps pooled with $SGL_CAL_POOL"
    mkdir -p "$S/sgl-test-pool/bench" "$S/sgl-test-pool/eval"
    cp "$test/bench/summary.json" "$test/bench/runs.jsonl" "$S/sgl-test-pool/bench/"
    cp "$test/eval/accept_len.json" "$S/sgl-test-pool/eval/"
    $PY eval/economics/analysis.py --config $CONFIG --run-dir "$S/sgl-test-pool" "${SGL[@]}" \
      --set "bench.calibration=$cal/bench/calibration.json" --set "bench.calibration_pool=[${SGL_CAL_POOL}]" \
      --set "bench.settings=$(settings_yaml "$SGL_SETTINGS")" 2>&1 | tail -8
  fi
  xargs -r kill < "$L/sgl.pids"
  say "offline tau on each speculative server's own answers (the tokens its live tau counted), side by side"
  local own=()
  for s in "${SGL_LIST[@]}"; do
    $PY eval/offline/same_prompts.py --config $CONFIG --run-dir "$S/sgl-own-${s//\//-}" "${SGL[@]}" --set "bench.prompts=$test_src" \
      --set "bench.max_new_tokens=$SGL_NEW" --set "bench.settings=$(settings_yaml "$s")" \
      --answers-from "$test" --answers-of "$s" > "$S/sgl-own-${s//\//-}.txt" 2>&1 &
    own+=($!)
  done
  wait "${own[@]}"
  for s in "${SGL_LIST[@]}"; do echo "$s: $(tail -1 "$S/sgl-own-${s//\//-}.txt")"; done
  mkdir -p "$L/sgl"
  for run in "$cal" "$test" "$S/sgl-cal2" "$S/sgl-test-pool" "$S"/sgl-own-*; do
    [[ -d $run ]] || continue
    cp "$run.txt" "$L/sgl/" 2>/dev/null
    for f in summary economics prediction calibration; do cp "$run/bench/$f.json" "$L/sgl/$(basename "$run")-$f.json" 2>/dev/null; done
    cp "$run/bench/runs.jsonl" "$L/sgl/$(basename "$run")-runs.jsonl" 2>/dev/null
    cp "$run/eval/accept_len.json" "$L/sgl/$(basename "$run")-accept_len.json" 2>/dev/null
  done
}
emb_eager() {  # phase 4: eval/bench/live.py as 2's measurement with EMB_AB_SET, one setting
  local st tk nd
  IFS=/ read -r st tk nd <<< "${EMB_AB_SETTING:-5/1/6}"
  CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=2 timeout 480 $PY eval/bench/live.py --config $CONFIG --run-dir "$S/emb-eager" "${BASE[@]}" \
    --set bench.embedded.attention=${EMB_ATTENTION:-chain} --set "${EMB_AB_SET:-bench.embedded.drafting=eager}" --set "eval.checkpoint=$SHIPPED" \
    --set "bench.prompts={kind: mtbench, limit: ${EMB_PROMPTS:-4}, path: $DATA/mtbench-questions.jsonl}" \
    --set "bench.max_new_tokens=${EMB_NEW:-384}" --set "bench.repetitions=${EMB_REPS:-3}" --set "bench.drafters={}" \
    --set "bench.settings=[{steps: $st, topk: $tk, num_draft_tokens: $nd}]" > "$L/emb-eager.txt" 2>&1
  echo "exit $?"; tail -12 "$L/emb-eager.txt"
  mkdir -p "$L/emb-eager" && cp "$S"/emb-eager/bench/{summary,economics}.json "$S/emb-eager/bench/runs.jsonl" "$L/emb-eager/" 2>/dev/null
}
gpu_tests() {  # phase 0: the GPU tests of the embedded decoder's CUDA paths (EMB_DRAFTING eager if the graphed chain
               # fails them), then the embedded bench's features in the background (FEATS: its pid)
  local t
  wait_for 600 "$MODEL/config.json"
  say "0. GPU tests (the graphed draft chain and its extend, chain attention) and the embedded bench's features"
  timeout 300 $PY -m pytest -q -ra -m gpu -p no:cacheprovider tests/test_gpu.py -k "draft_chain or chain_attention" > "$L/gpu-tests.txt" 2>&1
  echo "exit $?"; tail -3 "$L/gpu-tests.txt"
  EMB_DRAFTING=${EMB_DRAFTING:-auto}
  if grep -q "FAILED.*draft_chain.*False" "$L/gpu-tests.txt"; then
    echo "the graphed draft chain failed its GPU test: the embedded benches draft eagerly"; EMB_DRAFTING=eager
  fi
  ( t=$SECONDS; emb features; echo "features exit $? in $((SECONDS - t)) s" ) > "$L/emb-features.txt" 2>&1 &
  FEATS=$!
}
emb_phase() {  # emb_phase TITLE: the embedded calibration, prediction and measurement (calibrated_prediction.sh)
  local t=$SECONDS
  say "$1"
  emb cal; echo "cal exit $?"
  emb test; echo "test exit $?"; tail -30 "$L/embedded.txt"
  pred_back
  echo "phase embedded: $((SECONDS - t)) s"
}
s15() {
  local t
  gpu_tests
  local feats=$FEATS
  say "1. SGLang servers: plain, then $SGL_SETTINGS with the shipped drafter, one at a time"
  wait_for 600 "$SGL_DIR/.ready"
  local flags=${SGL_SERVER_FLAGS---sleep-on-idle}
  if [[ -z ${SGL_EXTRA:-} && -n $flags ]] && ! PYTHONPATH=$SGL_DIR SGLANG_ENABLE_JIT_DEEPGEMM=0 timeout 180 $PY -m sglang.launch_server --help 2>&1 | grep -q -- "--sleep-on-idle"; then
    echo "this SGLang has no --sleep-on-idle: the servers start without it"; flags=
  fi
  SGL+=(--set "serve.extra_args=[$flags]")
  t=$SECONDS
  sgl_servers > "$L/sgl-up.txt" 2>&1; cat "$L/sgl-up.txt"; echo "phase sgl_servers: $((SECONDS - t)) s"
  wait "$feats"; cat "$L/emb-features.txt"
  emb_phase "2. embedded: the shipped drafter, calibrated on HumanEval, predicted and measured on MT-Bench (servers idle)"
  if [[ -f $L/.sgl-up ]]; then
    t=$SECONDS; sglang_phase; echo "phase sglang: $((SECONDS - t)) s"
  else
    echo "no SGLang server came up: no SGLang bench"; xargs -r kill < "$L/sgl.pids" 2> /dev/null
  fi
  if [[ ${EMB_AB:-1} == 1 ]]; then
    say "4. embedded, the A side: ${EMB_AB_SET:-bench.embedded.drafting=eager} at ${EMB_AB_SETTING:-5/1/6}"
    t=$SECONDS; emb_eager; echo "phase emb_eager: $((SECONDS - t)) s"
  fi
}

case ${1:-} in
  lib) ;;  # sourced by a later plan (benchmarks/leases/plans/sglang_live_trees.sh): the functions only
  run) shift; mkdir -p "$L" "$S"; s15; say done; touch "$L/.done-s15" ;;
  *) LEASE_SCRIPT=benchmarks/leases/plans/embedded_draft_graph.sh exec bash benchmarks/leases/run_phases.sh "$@" ;;
esac
