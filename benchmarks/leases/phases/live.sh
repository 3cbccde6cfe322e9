# Sourced by benchmarks/leases/run_phases.sh: the live benches: SGLang servers of eagle3ft.targets.sglang_server, plain
# against EAGLE-3, the SGLang calibrated prediction (sglpred) and the embedded one (benchmarks/leases/calibrated_prediction.sh).
SHIPPED=$PWD/drafters/smollm2-135m  # the drafter the live benches measure
SGL=(--set target.kind=hf --set "target.path=$MODEL" --set target.gguf_file=null --set target.dtype=bfloat16
     --set "drafter.config=$SHIPPED/config.json" --set "eval.checkpoint=$SHIPPED" --set "serve.python=$PY"
     --set "serve.model_path=$MODEL" --set serve.attention_backend=triton --set serve.sampling_backend=pytorch
     --set serve.mem_fraction_static=0.1 --set serve.startup_timeout_s=900 --set "serve.log_dir=$L")
# a dry run on a CPU: SGL_EXTRA="--set serve.launch_cmd=[tests/sglang_double.py]" (an array of another name: bash
# exports no arrays, and `start` passes the environment on to `run`)
read -r -a SGL_EXTRA_SETS <<< "${SGL_EXTRA:-}"
SGL+=("${SGL_EXTRA_SETS[@]}")
SGL_PIDS=()  # port -> the pid of its launcher (sgl_serve)
sgl_serve() {  # sgl_serve PORT GPU ROLE...: an SGLang server of eagle3ft.targets.sglang_server in the background (MEMF:
               # its --mem-fraction-static, 0.1)
  local port=$1 gpu=$2; shift 2
  $PY -m eagle3ft.targets.sglang_server "$@" --config $CONFIG --run-dir "$S/sgl$port" "${SGL[@]}" --port "$port" \
    --set "serve.mem_fraction_static=${MEMF:-0.1}" \
    --set "serve.env={PYTHONPATH: '$SGL_DIR', SGLANG_ENABLE_JIT_DEEPGEMM: '0', CUDA_VISIBLE_DEVICES: '$gpu'}" \
    > "$L/sgl-server$port.json" 2> "$L/sgl-server$port.log" &
  SGL_PIDS[port]=$!
  echo $! >> "$L/sgl.pids"
}
sgl_wait() {  # sgl_wait PORT...: every one healthy within SGL_WAIT_S (15 min: the wheels may still be on their way)
  local end=$((SECONDS + ${SGL_WAIT_S:-900})) port
  until [[ -f $SGL_DIR/.ready ]]; do (( SECONDS < end )) || { echo "no SGLang wheels"; return 1; }; sleep 5; done
  for port in "$@"; do
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
      if (( SECONDS >= end )) || ! kill -0 "${SGL_PIDS[port]:-0}" 2> /dev/null; then  # its launcher exits with it
        echo "SGLang server :$port not up"; tail -5 "$L/sgl-server$port.log"; return 1
      fi
      sleep 3
    done
  done
}
sgl_up() {  # a plain server on GPU 0 and an EAGLE-3 3/1/4 one with the shipped drafter on GPU 1, beside the training
  local end=$((SECONDS + 900))
  until [[ -f $SGL_DIR/.ready ]]; do (( SECONDS < end )) || { echo "no SGLang wheels"; return 1; }; sleep 5; done
  sgl_serve 30100 0 --role baseline
  sgl_serve 30101 1 --role speculative --drafter "$SHIPPED" --setting 3/1/4
  sgl_wait 30100 30101 || return 1
  echo "SGLang up: plain :30100 (GPU 0), EAGLE-3 3/1/4 :30101 (GPU 1)"; touch "$L/.sgl-up"
}
SGL_SETS=("general8 {kind: mtbench, limit: ${SGL_LIMIT:-8}, path: $DATA/mtbench-general.jsonl} ${SGL_NEW:-192}"
          "humaneval8 {kind: humaneval, limit: ${SGL_LIMIT:-8}, path: $DATA/HumanEval.jsonl.gz} ${SGL_NEW:-192}"
          "general8-long {kind: mtbench, limit: ${SGL_LIMIT:-8}, path: $DATA/mtbench-general.jsonl} ${SGL_LONG:-1024}")
sgl_set() {  # sgl_set SPEC: NAME, SRC and NEW of one SGL_SETS entry
  name=${1%% *} new=${1##* } src=${1#* }; src=${src% *}
}
sgl_bench_one() {  # sgl_bench_one RUN SRC NEW SPEC_PORT [sets...]: plain (:30100) vs 3/1/4 interleaved, 3 repetitions
  local run=$1 src=$2 new=$3 port=$4; shift 4
  timeout 300 $PY eval/bench/sglang_backend.py --config $CONFIG --run-dir "$run" "${SGL[@]}" --set bench.backend=sglang \
    --set bench.sglang.baseline_url=http://127.0.0.1:30100 --set "bench.sglang.speculative_url=http://127.0.0.1:$port" \
    --set "bench.prompts=$src" --set "bench.max_new_tokens=$new" --set bench.repetitions=3 \
    --set 'bench.settings=[{steps: 3, topk: 1, num_draft_tokens: 4}]' --set 'bench.concurrency=[1]' --set 'bench.drafters={}' \
    "$@" > "$run.txt" 2>&1
  echo "exit $?"; tail -8 "$run.txt"
}
sgl_bench() {  # plain vs 3/1/4 on the running servers, interleaved, 3 repetitions, per prompt set (batch 1)
  [[ -f $L/.sgl-up ]] || { echo "SGLang servers not up: no SGLang bench"; return 1; }
  local spec name src new
  for spec in "${SGL_SETS[@]}"; do
    sgl_set "$spec"
    say "SGLang bench: $name, $new new tokens"
    sgl_bench_one "$S/sgl-$name" "$src" "$new" 30101
    cp "$S/sgl-$name.txt" "$L/sgl-bench-$name.txt"; cp "$S/sgl-$name/bench/summary.json" "$L/sgl-bench-$name.json" 2>/dev/null
  done
  xargs -r kill < "$L/sgl.pids"
}
sglpred_serve() {  # sglpred_serve PORT SLOT [DRAFTER [SETTING]]: on GPU SGL_GPU (0), the SLOT-th server there (from 0),
                   # with 0.1 of the GPU (mem_fraction): plain, or EAGLE-3 with DRAFTER at SETTING (3/1/4); healthy
                   # within 15 min
  local port=$1 slot=$2 role=(--role baseline)
  [[ -n ${3:-} ]] && role=(--role speculative --drafter "$3" --setting "${4:-3/1/4}")
  wait_for 900 "$SGL_DIR/.ready"
  MEMF=$(mem_fraction 0.1 "$slot") sgl_serve "$port" "${SGL_GPU:-0}" "${role[@]}"
  sgl_wait "$port" || { xargs -r kill < "$L/sgl.pids"; return 1; }
  echo "SGLang :$port up (GPU ${SGL_GPU:-0}, ${3:-plain})"
}
sglpred() {  # sglpred CAL TEST (issue 14.6 in SGLang, one lease): plain, CAL and TEST servers on GPU SGL_GPU (0); per
             # set, CAL's run calibrates the 3/1/4 cycle; TEST's tok/s is predicted from its offline tau on that run's
             # plain answers (eval/offline/same_prompts.py), written before TEST's own run; then TEST is measured
  [[ -f $2/config.json ]] || { echo "no drafter at $2: no SGLang prediction"; return 1; }
  say "SGLang calibrated prediction on GPU ${SGL_GPU:-0}: calibrate with $1, predict and measure $2"
  sglpred_serve 30100 0 && sglpred_serve 30101 1 "$1" && sglpred_serve 30102 2 "$2" && sglpred_bench "$2"
}
sglpred_bench() {  # sglpred_bench TEST: sglpred's runs, on its three servers once they are up (CAL on :30101, TEST on :30102)
  local test=$1 spec name src new
  local t=(--set "drafter.config=$test/config.json" --set "eval.checkpoint=$test")
  export CUDA_VISIBLE_DEVICES=${SGL_GPU:-0}  # the benches' in-process target (offline tau on the same prompts) beside them
  for spec in "${SGL_SETS[@]}"; do
    sgl_set "$spec"; say "calibration: $name, $new new tokens"
    sgl_bench_one "$S/sglcal-$name" "$src" "$new" 30101
  done
  for spec in "${SGL_SETS[@]}"; do
    sgl_set "$spec"; say "prediction: $name"
    $PY eval/offline/same_prompts.py --config $CONFIG --run-dir "$S/sgltest-$name" "${SGL[@]}" "${t[@]}" --set "bench.prompts=$src" \
      --set "bench.max_new_tokens=$new" --set 'bench.settings=[{steps: 3, topk: 1, num_draft_tokens: 4}]' \
      --answers-from "$S/sglcal-$name" 2>&1 | tail -1
    $PY eval/economics/analysis.py --config $CONFIG --run-dir "$S/sgltest-$name" "${SGL[@]}" "${t[@]}" \
      --set "bench.calibration=$S/sglcal-$name/bench/calibration.json" 2>&1 | tail -4
  done
  for spec in "${SGL_SETS[@]}"; do
    sgl_set "$spec"; say "measurement: $name"
    sgl_bench_one "$S/sgltest-$name" "$src" "$new" 30102 "${t[@]}" --set "bench.calibration=$S/sglcal-$name/bench/calibration.json"
  done
  xargs -r kill < "$L/sgl.pids"
  for spec in "${SGL_SETS[@]}"; do  # TEST's offline tau on its own server's answers: the tokens its live tau counted
    sgl_set "$spec"; say "offline tau on the speculative answers: $name"
    $PY eval/offline/same_prompts.py --config $CONFIG --run-dir "$S/sglown-$name" "${SGL[@]}" "${t[@]}" --set "bench.prompts=$src" \
      --set "bench.max_new_tokens=$new" --set 'bench.settings=[{steps: 3, topk: 1, num_draft_tokens: 4}]' \
      --answers-from "$S/sgltest-$name" --answers-of 3/1/4 2>&1 | tail -1
  done
  mkdir -p "$L/sglpred"
  for run in "$S"/sglcal-* "$S"/sgltest-* "$S"/sglown-*; do
    [[ -d $run ]] || continue
    cp "$run.txt" "$L/sglpred/" 2>/dev/null
    for f in summary economics prediction calibration; do cp "$run/bench/$f.json" "$L/sglpred/$(basename "$run")-$f.json" 2>/dev/null; done
    cp "$run/eval/accept_len.json" "$L/sglpred/$(basename "$run")-accept_len.json" 2>/dev/null
  done
}
embedded_step() {  # embedded_step STEPS CAL TEST: benchmarks/leases/calibrated_prediction.sh on GPU EMB_GPU (1), sizes EMB_*
  say "embedded ($1): calibrate with $2, predict and measure $3"
  CUDA_VISIBLE_DEVICES=${EMB_GPU:-1} STEPS=$1 EXTRA="${BASE[*]}" NEW=${EMB_NEW:-64} CAL_NEW=${EMB_CAL_NEW:-${EMB_NEW:-64}} \
    REPS=${EMB_REPS:-3} N_PROMPTS=${EMB_PROMPTS:-3} SETTINGS=${EMB_SETTINGS:-1/1/2,3/1/4,5/1/6} PY=$PY \
    MTBENCH=$DATA/mtbench-questions.jsonl DRAFTER_READY=${DRAFTER_READY:-} \
    timeout 900 bash benchmarks/leases/calibrated_prediction.sh "$S/pred" "$2" "$3" >> "$L/embedded.txt" 2>&1
  echo "exit $?"; tail -30 "$L/embedded.txt"
  pred_back
}
pred_back() {  # calibrated_prediction.sh's files in $S/pred into $L/pred: the calibration's, then the test's as test-*
  mkdir -p "$L/pred" && cp "$S"/pred/calibrate/bench/{summary,calibration,runs}.json* "$L/pred/" 2>/dev/null
  for f in summary economics prediction; do cp "$S/pred/test/bench/$f.json" "$L/pred/test-$f.json" 2>/dev/null; done
  cp "$S/pred/test/bench/runs.jsonl" "$L/pred/test-runs.jsonl" 2>/dev/null
  cp "$S/pred/test/eval/accept_len.json" "$L/pred/test-accept_len.json" 2>/dev/null
}
embedded() {  # the embedded calibrated prediction on GPU 1: calibrate with a weak drafter, predict, measure (small:
              # transformers decodes SmolLM2 at ~29 ms/token on the H200, RESULTS §10f)
  embedded_step all "$1" "$SHIPPED"
}
