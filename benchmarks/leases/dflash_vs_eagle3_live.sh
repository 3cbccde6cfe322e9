#!/usr/bin/env bash
# Does a DFlash drafter trained here beat plain and the shipped EAGLE-3 drafter in SGLang 0.5.17 on SmolLM2-135M?
# (issue 61.6) One `nvidia-h100-x1` or `nvidia-h200` lease, resumable in a second:
#   regen   SmolLM2 answers every ShareGPT conversation through plain SGLang servers (:30103, :30104), once per seed in
#           SEEDS at T=REGEN_T, REGEN_S seconds each (data/regen.py, token ids only): >= 10 M answer tokens over the
#           two seeds, as the shipped drafter had; each store's counts go to $L/regen-<seed>.json
#   layers  SGLang's capture of the DFlash layers checked live on LAYERS conversations: the EAGLE3 harvest server
#           (:30101) with the config-only capture draft configs/drafters/smollm2-135m-dflash-capture (dummy weights;
#           its ids are the DFlash ids in EAGLE-3's numbering, DFlashConfig.eagle3_capture_ids) against the embedded
#           capture of the same tokens (benchmarks/sglang_target.py compare-stores: cosine per token, all 5 chunks)
#   harvest the DFlash features of every regenerated conversation by the embedded target on the GPU (harvest.backend
#           hf: SGLang's JSON rows would be ~250 GB of text at 10 M tokens), AUX_DTYPE (fp8: 2.9 KB a token, where bf16's
#           5.8 KB would fill the 64 GB disk)
#   train   configs/drafters/smollm2-135m-dflash.json (5 layers, block 16, mask id 16) from scratch on that store, one
#           GPU, TRAIN_S seconds at most, held-out tau as the live chain walk, export-best by it
#   serve   plain (:30100), the shipped EAGLE-3 drafter at EAGLE (3/1/4, the economics' pick) (:30101) and the DFlash
#           export at its block B-1/1/B (:30102, --attention-backend triton), SGLang 0.5.17
#   bench   the three interleaved per prompt on the everyday set (data/sets/everyday-v1.jsonl, held out), REPS (3)
#           repetitions, at T=0 and T=0.7 (TEMPS), eval/bench/sglang_backend.py; each summary keeps tau, tok/s and
#           the sampled-verify settings per server, and per setting its cycle in plain steps (cycle_plain_steps)
# Each step that finishes writes $L/done.<step>; `run` skips the steps done, so a second `start` on the same machine
# goes on where the first stopped. Across leases: `wait` packs $L and the DFlash export (in 15 MiB pieces) into $OUT;
# carry them back and `resume DIR` puts the export in place and marks regen, layers, harvest and train done.
# Usage, from this machine (device calls back to back):
#   bash benchmarks/leases/live_speedup.sh pack            here, once: the wheels, the GGUF, ShareGPT, MT-Bench
#   bash benchmarks/leases/live_speedup.sh stash DIR       there: one call per carried piece
#   bash benchmarks/leases/dflash_vs_eagle3_live.sh resume DIR      there, a second lease only: the first lease's $OUT files
#   bash benchmarks/leases/dflash_vs_eagle3_live.sh start           there: install, convert the target, the steps (setsid)
#   bash benchmarks/leases/dflash_vs_eagle3_live.sh wait SECS       there: until done or SECS; $L and the export into $OUT
# Env: C (/tmp/c), L (/tmp/L), S (/tmp/S), MODEL (/tmp/smol-hf), SGL_DIR (/tmp/sgl), STEPS (regen layers harvest train
# serve bench), SEEDS (0 1), REGEN_T (0.8), REGEN_S (120: one server answered 33.6 k tokens/s at 256 in flight, shared
# GUIDE.md, so two seeds on two servers should pass 10 M if they do not slow each other; regen-<seed>.json counts them), NEW (512 new tokens a turn), LAYERS (32), AUX_DTYPE (fp8), TRAIN_S (600; held-out tau every
# train.eval_every steps writes export-best, so a run the timeout stops still has an export), TRAIN_STEPS (unset:
# epochs decide), LR (6e-4), EAGLE (3/1/4), REPS (3), TEMPS (0 0.7), PER_CAT (5 of the everyday set's prompts per
# category, 60), CONVS and MTB_LIMIT (conversations kept; unset: all).
# Two leases of 30 min: the first for install, regen, layers, harvest and train (~28 min at these defaults), the
# second (after `resume`) for serve and bench (~15 min: 60 prompts x 512 tokens, 3 arms x 3 repetitions x 2 T). On a CPU, the steps that need no SGLang run on the tiny
# target with CONFIG, DFLASH, REGEN_BACKEND=hf, DEVICE=cpu, ACCEL and MODEL unset (tests/test_dflash_vs_eagle3_live_plan.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
C=${C:-/tmp/c} L=${L:-/tmp/L} S=${S:-/tmp/S} MODEL=${MODEL-/tmp/smol-hf} SGL_DIR=${SGL_DIR:-/tmp/sgl} PY=${PY:-python3}
CONFIG=${CONFIG:-configs/smollm2-135m.yaml} DFLASH=${DFLASH:-configs/drafters/smollm2-135m-dflash.json}
CAPTURE=${CAPTURE:-configs/drafters/smollm2-135m-dflash-capture} SHIPPED=$PWD/drafters/smollm2-135m
DEVICE=${DEVICE:-cuda} STEPS=${STEPS:-regen layers harvest train serve bench}
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
say() { printf '\n== %s (%s, %s)\n' "$1" "$(date +%T)" "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader 2> /dev/null)"; }

TGT=(--set "target.device=$DEVICE" --set train.wandb_mode=disabled --set "serve.python=$PY" --set "serve.log_dir=$L"
     --set serve.attention_backend=triton --set serve.sampling_backend=pytorch --set serve.startup_timeout_s=600
     --set "serve.env={PYTHONPATH: '$SGL_DIR', SGLANG_ENABLE_JIT_DEEPGEMM: '0', CUDA_VISIBLE_DEVICES: '0'}")
[[ -n $MODEL ]] && TGT+=(--set target.kind=hf --set "target.path=$MODEL" --set target.gguf_file=null
                        --set target.dtype=bfloat16 --set "serve.model_path=$MODEL")
GRAPHS="--cuda-graph-max-bs-decode, '8', --cuda-graph-backend-prefill, disabled"
SOURCES="[{kind: file, path: $C/sharegpt-conversations.jsonl, name: sharegpt${CONVS:+, limit: $CONVS}}, {kind: mtbench, path: $C/mtbench-questions.jsonl, split: heldout${MTB_LIMIT:+, limit: $MTB_LIMIT}}]"
EVERYDAY="{kind: file, path: $PWD/data/sets/everyday-v1.jsonl, split: heldout, per_category: ${PER_CAT:-5}}"
stores() { local s out=""; for s in ${SEEDS:-0 1}; do out+="${out:+, }{kind: tokens, path: $S/regen$s/tokens}"; done; echo "[$out]"; }

server() {  # server PORT MEMF ROLE [args...]: one server in the background, its pid in $L/pid.PORT
  $PY -m eagle3ft.targets.sglang_server --config "$CONFIG" --run-dir "$S/sgl$1" "${TGT[@]}" --port "$1" \
    --set "serve.mem_fraction_static=$2" --role "${@:3}" > "$L/server$1.json" 2> "$L/server$1.log" &
  echo $! > "$L/pid.$1"
}
up() {  # up PORT...: each healthy within 10 min, or its log's tail
  local t=$SECONDS p
  for p in "$@"; do
    until curl -sf "http://127.0.0.1:$p/health" > /dev/null; do
      if (( SECONDS - t >= 600 )) || ! kill -0 "$(cat "$L/pid.$p" 2> /dev/null)" 2> /dev/null; then
        echo "server :$p not up"; tail -20 "$L/server$p.log"; return 1
      fi
      sleep 2
    done
    echo "server :$p up after $((SECONDS - t)) s"
  done
}
down() {  # down [PORT...]: those servers (all by default), then a pause while their GPU memory is freed
  local f p ports=("$@") killed=0
  (( ${#ports[@]} )) || ports=($(ls "$L" | sed -n 's/^pid\.//p'))
  for p in "${ports[@]}"; do
    f=$L/pid.$p; [[ -f $f ]] || continue
    kill "$(cat "$f")" 2> /dev/null; rm -f "$f"; killed=1
  done
  (( killed )) && sleep 10; return 0
}
export_of() { local ex=$S/$1/export-best; [[ -f $ex/config.json ]] || ex=$S/$1/export; echo "$ex"; }

regen() {
  local urls="[]" seed
  if [[ ${REGEN_BACKEND:-sglang} == sglang ]]; then
    say "regen: plain servers :30103 :30104"
    server 30103 0.3 baseline --set "serve.extra_args=[--skip-tokenizer-init, --max-running-requests, '256', $GRAPHS]"
    server 30104 0.43 baseline --set "serve.extra_args=[--skip-tokenizer-init, --max-running-requests, '256', $GRAPHS]"
    up 30103 30104 || { down; return 1; }
    urls="[http://127.0.0.1:30103, http://127.0.0.1:30104]"
  fi
  for seed in ${SEEDS:-0 1}; do
    say "regen seed $seed: ShareGPT conversations at T=${REGEN_T:-0.8}, ${REGEN_S:-120} s at most"
    timeout -k 30 $((${REGEN_S:-120} + 300)) $PY data/regen.py --config "$CONFIG" --run-dir "$S/regen$seed" "${TGT[@]}" \
      --set "harvest.backend=${REGEN_BACKEND:-sglang}" --set "harvest.sglang.urls=$urls" --set harvest.sglang.concurrency=128 \
      --set harvest.sglang.prompts_per_request=8 --set "harvest.max_seconds=${REGEN_S:-120}" --set "seed=$seed" \
      --set "harvest.temperature=${REGEN_T:-0.8}" --set "harvest.max_new_tokens=${NEW:-512}" --set harvest.max_total_tokens=4096 \
      --set harvest.max_turns=1000 --set harvest.heldout_fraction=0.02 --set "harvest.sources=$SOURCES" \
      > "$L/regen-$seed.json" 2> "$L/regen-$seed.log"
    echo "regen $seed exit $?"; tail -c 600 "$L/regen-$seed.json"
    [[ -f $S/regen$seed/tokens/manifest.json ]] || { down; return 1; }
  done
  down
}
layers() {  # SGLang's capture of the DFlash layers against the embedded capture, on the same LAYERS conversations
  say "layers: the EAGLE3 capture server (:30101, dummy capture draft) against the embedded target"
  server 30101 0.3 harvest --set "drafter.config=$DFLASH" --set "serve.harvest_draft=$CAPTURE" \
    --set "serve.extra_args=[--skip-tokenizer-init, --speculative-draft-load-format, dummy, $GRAPHS]"
  up 30101 || { down; return 1; }
  local seeds=${SEEDS:-0 1} b
  local src="[{kind: tokens, path: $S/regen${seeds%% *}/tokens, limit: ${LAYERS:-32}}]"
  for b in sglang hf; do
    $PY data/harvest.py --config "$CONFIG" --run-dir "$S/lay-$b" "${TGT[@]}" --set "drafter.config=$DFLASH" \
      --set "harvest.backend=$b" --set "harvest.sglang.urls=[http://127.0.0.1:30101]" --set "harvest.sources=$src" \
      --set harvest.regenerate=false --set harvest.aux_row_check=skip > "$L/harvest-lay-$b.json" 2> "$L/harvest-lay-$b.log"
    echo "harvest lay-$b exit $?"
  done
  down
  $PY benchmarks/sglang_target.py compare-stores "$S/lay-sgl" "$S/lay-hf" --out "$L/layers-cos.json" > /dev/null
  cat "$L/layers-cos.json"
}
harvest() {  # every regenerated conversation's DFlash features by the embedded target
  say "harvest: the DFlash layers of $(stores) by the embedded target, ${AUX_DTYPE:-fp8}"
  $PY data/harvest.py --config "$CONFIG" --run-dir "$S/feat" "${TGT[@]}" --set "drafter.config=$DFLASH" \
    --set harvest.backend=hf --set "harvest.sources=$(stores)" --set harvest.regenerate=false \
    --set "harvest.aux_dtype=${AUX_DTYPE:-fp8}" --set "harvest.batch_size=${HARVEST_BATCH:-16}" \
    > "$L/harvest-feat.json" 2> "$L/harvest-feat.log"
  local rc=$?
  echo "harvest exit $rc"; tail -c 800 "$L/harvest-feat.json"
  return $rc
}
train() {  # the DFlash drafter from scratch on $S/feat
  say "train: $DFLASH on $S/feat, ${TRAIN_S:-600} s at most"
  mkdir -p "$S/dflash" && ln -sfn "$S/feat/features" "$S/dflash/features"
  local max=()
  [[ -n ${TRAIN_STEPS:-} ]] && max=(--set "train.max_steps=$TRAIN_STEPS" --set "train.save_every=$TRAIN_STEPS"
                                   --set "train.eval_every=$(( (TRAIN_STEPS + 1) / 2 ))")
  timeout "${TRAIN_S:-600}" accelerate launch --config_file "${ACCEL:-configs/accelerate/1gpu.yaml}" ${NPROC:+--num_processes "$NPROC"} \
    --main_process_port "${PORT:-29621}" train/finetune.py --config "$CONFIG" --run-dir "$S/dflash" "${TGT[@]}" \
    --set "drafter.config=$DFLASH" --set drafter.init=null --set "train.lr=${LR:-6e-4}" --set train.keep_checkpoints=1 \
    --set train.log_every=10 "${max[@]}" > "$L/train-dflash.log" 2>&1
  local rc=$?
  echo "dflash exit $rc"; mkdir -p "$L/dflash"; cp "$S/dflash"/train/{metrics.jsonl,data.json} "$L/dflash/" 2> /dev/null
  tail -3 "$L/train-dflash.log"
  [[ -f $(export_of dflash)/config.json ]]
}
block_of() { $PY -c "from eagle3ft.drafter.dflash_config import DFlashConfig as D; b = D.from_json('$1/config.json').block_size; print(f'{b - 1}/1/{b}')"; }
serve() {  # plain, the shipped EAGLE-3 drafter at $EAGLE and the DFlash export at its block, a tenth of the GPU each
  local ex block
  ex=$(export_of dflash); block=$(block_of "$ex") || return 1
  say "serve: plain :30100, EAGLE-3 ${EAGLE:-3/1/4} :30101, DFlash $block :30102 ($ex)"
  server 30100 0.1 baseline --set "serve.extra_args=[--sleep-on-idle, $GRAPHS]"
  server 30101 0.111 speculative --drafter "$SHIPPED" --setting "${EAGLE:-3/1/4}" --set "serve.extra_args=[--sleep-on-idle, $GRAPHS]"
  server 30102 0.125 speculative --drafter "$ex" --setting "$block" --set "serve.extra_args=[--sleep-on-idle, $GRAPHS]"
  up 30100 30101 30102
}
bench() {  # the three servers interleaved per prompt, at each temperature
  local ex block t st tk nd yaml=""
  ex=$(export_of dflash); block=$(block_of "$ex") || return 1
  for s in "${EAGLE:-3/1/4}" "$block"; do IFS=/ read -r st tk nd <<< "$s"; yaml+="${yaml:+, }{steps: $st, topk: $tk, num_draft_tokens: $nd}"; done
  for t in ${TEMPS:-0 0.7}; do
    say "bench T=$t: plain, EAGLE-3 ${EAGLE:-3/1/4}, DFlash $block, ${REPS:-3} repetitions, interleaved per prompt"
    timeout 1800 $PY eval/bench/sglang_backend.py --config "$CONFIG" --run-dir "$S/bench-t$t" "${TGT[@]}" \
      --set bench.sglang.baseline_url=http://127.0.0.1:30100 \
      --set "bench.sglang.speculative_urls=[http://127.0.0.1:30101, http://127.0.0.1:30102]" --set "bench.settings=[$yaml]" \
      --set "bench.prompts=$EVERYDAY" --set bench.max_new_tokens=512 --set "bench.repetitions=${REPS:-3}" \
      --set "bench.temperature=$t" --set bench.interleave=prompt --set 'bench.concurrency=[1]' --set bench.warmup=first \
      --set bench.sglang.same_prompts=false --set 'bench.drafters={}' --set "eval.checkpoint=$ex" \
      --set "drafter.config=$ex/config.json" > "$L/bench-t$t.txt" 2>&1
    echo "bench T=$t exit $?"; tail -20 "$L/bench-t$t.txt"
    mkdir -p "$L/bench-t$t"; cp "$S/bench-t$t"/bench/{summary.json,runs.jsonl,sglang_requests.jsonl} "$L/bench-t$t/" 2> /dev/null
  done
  down
}

run() {
  local step t
  for step in $STEPS; do
    [[ -f $L/done.$step ]] && { echo "step $step: done before"; continue; }
    t=$SECONDS
    $step && touch "$L/done.$step"
    echo "step $step: exit $? in $((SECONDS - t)) s"
  done
  down
}

case ${1:-} in
  start)
    bash benchmarks/leases/live_speedup.sh install || exit 1
    export PYTHONPATH=/tmp/eagle3ft-site:/tmp/dsw
    [[ -f $MODEL/config.json ]] || $PY benchmarks/sglang_target.py export-hf --config "$CONFIG" \
      --set "target.path=/tmp/lspack/SmolLM2-135M-Instruct.Q4_1.gguf" --out "$MODEL" || exit 1
    tree=/tmp/tree-dflash-$$ && mkdir -p "$tree" && tar --exclude=./.carry --exclude=./.git --exclude=./.venv -cf - . | tar -xf - -C "$tree"
    (cd "$tree" && PYTHONPATH=$PYTHONPATH setsid nohup bash benchmarks/leases/dflash_vs_eagle3_live.sh run >> "$L/log" 2>&1 < /dev/null &)
    echo "started from $tree" ;;
  run) mkdir -p "$L" "$S"; rm -f "$L/.done"; say "steps: $STEPS"; run; say done; touch "$L/.done" ;;
  wait)
    bash benchmarks/leases/live_speedup.sh wait "${2:-60}"
    ex=$(export_of dflash)
    if [[ -n ${OUT:-} && -f $ex/config.json ]]; then  # $OUT takes files of 16 MiB at most
      mkdir -p "$OUT/dflash-export" && cp "$ex/config.json" "$OUT/dflash-export/"
      split -b 15m "$ex/model.safetensors" "$OUT/dflash-export/model.safetensors.part-"
      cp "$L"/done.* "$OUT/dflash-export/" 2> /dev/null; ls -la "$OUT/dflash-export"
    fi ;;
  resume)  # resume DIR: the first lease's dflash-export folder, back in place, its steps marked done
    [[ -f ${2:-}/config.json ]] || { echo "usage: $0 resume DIR (DIR: a dflash-export folder from wait)"; exit 2; }
    mkdir -p "$S/dflash/export" "$L" && cp "$2/config.json" "$S/dflash/export/"
    cat "$2"/model.safetensors.part-* > "$S/dflash/export/model.safetensors" || exit 1
    cp "$2"/done.* "$L/" 2> /dev/null; touch "$L"/done.{regen,layers,harvest,train}; ls "$L" "$S/dflash/export" ;;
  *) echo "usage: $0 start | run | wait SECS | resume DIR (pack and stash: benchmarks/leases/live_speedup.sh)" >&2; exit 2 ;;
esac
