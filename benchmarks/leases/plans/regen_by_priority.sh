#!/usr/bin/env bash
# One `nvidia-h200` lease (one GPU, 16 host cores) for issues 13 and 14, over benchmarks/leases/run_phases.sh's phases:
#   1. regen with the new scheduling (data/regen.py: priority = user turns left, sent to servers started with
#      --enable-priority-scheduling; a conversation stays on one server) at SETTING (1024x1), PER_GPU (3) plain
#      servers on the GPU, on §14a's workload (all of ShareGPT + CHITCHAT (3000) chitchat conversations, MT-Bench held
#      out, T=0): §14a made 44.9 k answer tokens/s there with first-come-first-served turns at 128x8. Then HumanEval.
#   2. a second pass over the same prompts sampled at T2 (0.7, top-p 0.95) with all CHITCHAT2 (7168) chitchat
#      conversations, into $S/t07; then the held-out features of both sets.
#   3. RUNS=ttt3x2 (the shipped recipe: EAGLE-3.1, CE, TTT 3, online, packed) on both passes for EPOCHS (2).
#   4. offline tau (every root, cycle walk) of it and of the shipped drafter on MT-Bench and HumanEval, and
#      benchmarks/tau_split.py (the answers that finished) on MT-Bench.
# With TOKENS (a folder of the tokens-*.tgz.part-* that `wait SECS tokens` brought back) steps 1-2 are skipped: the
# stores are unpacked, and neither SGLang nor the prompt files need to be carried.
# Usage as run_phases.sh (pack, stash, setup, wait): `bash benchmarks/leases/plans/regen_by_priority.sh start` starts the plan. Keep a `wait`
# call in flight all the time: a machine with no call for 30 s is given back with the job on it (RESULTS §12, §13, §16b).
set -uo pipefail
cd "$(dirname "$0")/../../.."
RUNS=${RUNS:-ttt3x2}
: "${EPOCHS:=2}" "${TRAIN_S:=480}" "${EVAL_EVERY:=300}" "${CHITCHAT:=3000}" "${REGEN_S:=420}" "${SETTING:=1024x1}"
export EPOCHS TRAIN_S EVAL_EVERY CHITCHAT REGEN_S SETTING
source benchmarks/leases/run_phases.sh lib

pass2() {  # the same prompts sampled at T2, train split only, into $S/t07
  regen_run "$S/t07" "[{kind: sharegpt, path: $DATA/sharegpt-prompts.json${LIMIT:+, limit: $LIMIT}}, {kind: chitchat, path: $C/d/chitchat.json, limit: ${CHITCHAT2:-7168}}]" \
    --set "harvest.temperature=${T2:-0.7}" --set "harvest.top_p=${TOP_P2:-0.95}" > "$L/regen-t07.json" 2> "$L/regen-t07.log"
  echo "exit $?"; tail -c 1200 "$L/regen-t07.json"
}

s13() {
  local t n
  wait_for 600 "$MODEL/config.json"
  if [[ -n ${TOKENS:-} ]]; then  # the token stores of an earlier lease (`wait SECS tokens`): no SGLang, no regeneration
    regen || return 1
  else
    regen_passes || return 1
  fi
  t=$SECONDS
  HELD_GPU=0 heldout > "$L/heldout.txt" 2>&1; tail -c 600 "$L/heldout.txt"
  echo "phase heldout: $((SECONDS - t)) s"

  say "3. train $NAMES on both passes"
  t=$SECONDS
  train
  echo "phase train: $((SECONDS - t)) s"

  say "4. offline tau of $NAMES and the shipped drafter"
  t=$SECONDS
  mkdir -p "$S/shipped" && ln -sfn "$SHIPPED" "$S/shipped/export-best"
  NAMES="$NAMES shipped" EVAL_GPU=0 evaluate
  for n in $NAMES shipped; do
    [[ -d $S/$n/export-best ]] || continue
    OMP_NUM_THREADS=8 $PY benchmarks/tau_split.py --config $CONFIG --run-dir "$S/eval-mtbench" --drafter "$S/$n/export-best" \
      --steps 3 --set "target.path=$MODEL" --set target.gguf_file=null --out "$L/tau_split-$n.json" > /dev/null 2> "$L/tau_split-$n.log" &
  done
  wait
  for n in "$L"/tau_split-*.json; do echo "$n: $($PY -c "import json, sys; p = json.load(open(sys.argv[1]))['parts']; print({k: v['tau']['3/1/4'] for k, v in p.items()})" "$n")"; done
  echo "phase eval: $((SECONDS - t)) s"
}

regen_passes() {  # steps 1 and 2: both regeneration passes through PER_GPU servers on the one GPU
  local t n
  wait_for 1200 "$SGL_DIR/.ready"
  ulimit -n "$(ulimit -Hn)" 2> /dev/null  # SETTING's connections: 1024 per server, client and server side
  echo "open files: $(ulimit -n); ${PER_GPU:-3} servers x ${SETTING%x*} requests in flight"
  say "1. regen, ${PER_GPU:-3} servers on one GPU at $SETTING (priority ${PRIO:-1}): ShareGPT (all) + chitchat ($CHITCHAT)"
  mkdir -p "$S"
  t=$SECONDS
  PER_GPU=${PER_GPU:-3} NGPU=1 servers_up || { servers_down; return 1; }
  echo "phase servers_up: $((SECONDS - t)) s"
  regen_stores
  for n in "$L"/server[0-9].log; do cp "$n" "${n%.log}.pass1.log"; done  # the second pass logs on into the same files

  say "2. the second pass at T=${T2:-0.7}, then the held-out features (the servers hold 0.85 of the GPU until then)"
  t=$SECONDS
  pass2
  echo "phase regen-t07: $((SECONDS - t)) s"
  gen_throughput > "$L/gen-throughput-both.txt"
  servers_down
  touch "$L/.regen-done"
}

case ${1:-} in
  run) shift; mkdir -p "$L" "$S"; s13; say done; touch "$L/.done-s13" ;;
  *) LEASE_SCRIPT=benchmarks/leases/plans/regen_by_priority.sh exec bash benchmarks/leases/run_phases.sh "$@" ;;
esac
