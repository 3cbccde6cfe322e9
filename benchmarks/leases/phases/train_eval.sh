# Sourced by benchmarks/leases/run_phases.sh: the phases gpu, regen, heldout, train and eval: GPU tests, the token stores,
# the held-out features, the drafters of RUNS trained side by side, their offline tau.
gpu() {  # issue 18: the CUDA-only paths against their references, and eager vs compiled at K2 dims
  say "gpu tests"
  timeout 240 $PY -m pytest -q -ra -m gpu -p no:cacheprovider tests/test_gpu.py -k "not k2_dims" > "$L/gpu-tests.txt" 2>&1
  echo "exit $?"; tail -4 "$L/gpu-tests.txt"
  timeout 150 $PY -m pytest -q -ra -p no:cacheprovider tests/test_train_online.py tests/test_train_losses.py -k cuda > "$L/gpu-tests-train.txt" 2>&1
  echo "exit $?"; tail -4 "$L/gpu-tests-train.txt"
  grep -q "passed" "$L/gpu-tests-train.txt" && ! grep -q "failed" "$L/gpu-tests-train.txt" || touch "$L/.varlen-failed"
  say "compile check (k2, bf16)"
  timeout 200 $PY benchmarks/compile_check.py --dims k2 --seq 1024 --emulate --train-steps 5 --out "$L/compile_check_k2.json" > "$L/compile_check_k2.txt" 2>&1
  echo "exit $?"; tail -25 "$L/compile_check_k2.txt"
  touch "$L/.gpu-done"
}
regen() {
  if [[ -n ${TOKENS:-} ]]; then  # a token store an earlier lease brought back (wait SECS tokens): no regeneration
    say "regen: the carried token store $TOKENS"
    local a
    for a in $(ls "$TOKENS"/tokens*.tgz.part-* | sed 's/[.]part-[a-z]*$//' | sort -u); do  # one archive per store group
      cat "$a".part-* | tar -xzf - -C "$S" || return 1
    done
    touch "$L/.regen-done"
    ls "$S"/*/tokens/manifest.json
    return
  fi
  say "regen: ShareGPT (all) + chitchat ($SETTING, MT-Bench held out)"
  servers_up || return 1
  regen_stores
  servers_down
  touch "$L/.regen-done"
}
main_sources() {  # the main store's prompt sources: ShareGPT (all, or LIMIT), CHITCHAT chitchat, MT-Bench held out
  echo "[{kind: sharegpt, path: $DATA/sharegpt-prompts.json${LIMIT:+, limit: $LIMIT}}, {kind: chitchat, path: $C/d/chitchat.json, limit: ${CHITCHAT:-2000}}, {kind: mtbench, path: $DATA/mtbench-questions.jsonl, split: heldout${MT_LIMIT:+, limit: $MT_LIMIT}}]"
}
regen_stores() {  # on the running servers: the main store (ShareGPT, chitchat, MT-Bench held out), then HumanEval held out
  local t=$SECONDS
  regen_run "$S/main" "$(main_sources)" > "$L/regen-main.json" 2> "$L/regen-main.log"
  echo "exit $?; phase regen-main: $((SECONDS - t)) s"; tail -c 1200 "$L/regen-main.json"
  gen_throughput | tee "$L/gen-throughput.txt"
  say "regen: HumanEval (held out)"
  regen_run "$S/humaneval" "[{kind: humaneval, path: $DATA/HumanEval.jsonl.gz, split: heldout${HE_LIMIT:+, limit: $HE_LIMIT}}]" > "$L/regen-humaneval.json" 2> "$L/regen-humaneval.log"
  echo "exit $?"; tail -c 400 "$L/regen-humaneval.json"
}
heldout() {  # offline features of each held-out set, captured from its regenerated tokens by the embedded target
  local name src
  for name in mtbench humaneval; do
    src=$S/main/tokens; [[ $name == humaneval ]] && src=$S/humaneval/tokens
    say "features: $name"
    CUDA_VISIBLE_DEVICES=${HELD_GPU:-0} $PY data/harvest.py --config $CONFIG --run-dir "$S/eval-$name" "${BASE[@]}" "${GEN[@]}" --set harvest.batch_size=64 \
      --set "harvest.sources=[{kind: tokens, path: $src, split: heldout${HELD_LIMIT:+, limit: $HELD_LIMIT}}]" > "$L/harvest-$name.json" 2> "$L/harvest-$name.log" &
  done
  wait
  tail -c 300 "$L"/harvest-*.json
}
train_one() {  # train_one NAME GPUS PORT [sets...]: GPUS "0", or "0,1" for one run over both (2 ranks)
  local name=$1 gpu=$2 port=$3 accel=${ACCEL:-configs/accelerate/1gpu.yaml}; shift 3
  [[ $gpu == *,* ]] && accel=configs/accelerate/2gpu.yaml
  mkdir -p "$S/$name" && ln -sfn "$S/main/tokens" "$S/$name/tokens"
  [[ -f $L/.varlen-failed ]] && export EAGLE3FT_TTT_ATTENTION=lse  # packed batches then take the masked SDPA path
  CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=2 timeout -s INT "${TRAIN_S:-300}" accelerate launch --config_file "$accel" \
    --main_process_port "$port" train/finetune.py --config $CONFIG --run-dir "$S/$name" --resume auto "${BASE[@]}" \
    --set train.features=online --set "train.pack_tokens=${PACK:-32768}" --set train.max_len=4096 --set "train.epochs=${EPOCHS:-2}" \
    --set "train.lr=${LR:-2e-3}" --set train.warmup_steps=50 --set train.save_every=200 --set "train.eval_every=${EVAL_EVERY:-100}" \
    --set train.eval_samples=256 --set train.log_every=10 "$@" > "$L/train-$name.log" 2>&1
  echo "$name exit $?"
}
runs() {  # the drafters of RUNS, "name gpus [sets...]" per line (ONLY keeps the names it lists)
  local v31="--set drafter.fc_norm=true --set drafter.norm_output=true" m="--set train.max_answer_tokens"
  case ${RUNS:-${PAIR:-layout}} in
    layout) printf '%s\n' "eagle3 0" "eagle31 1 $v31" ;;
    loss) printf '%s\n' "eagle31 0 $v31" "eagle31-${LOSS2:-lk_hybrid} 1 $v31 --set train.loss=${LOSS2:-lk_hybrid}" ;;
    curve)  # EAGLE-3.1, CE, EPOCHS over nested seeded subsets of the token store (the full store is §9's run); at
            # 2 M answer tokens one change each: layout parts, lr, ttt_steps, fp8 aux states, 2 ranks; 6 epochs at 0.7 M
      printf '%s\n' "c5m 0 $v31 $m=5000000" "c0.7m 0 $v31 $m=700000" "c2m-lr4e-3 0 $v31 $m=2000000 --set train.lr=4e-3" \
        "c2m-fp8 0 $v31 $m=2000000 --set harvest.aux_dtype=fp8" \
        "c2m 1 $v31 $m=2000000" "c2m-eagle3 1 $m=2000000" "c2m-fcnorm 1 --set drafter.fc_norm=true $m=2000000" \
        "c2m-normout 1 --set drafter.norm_output=true $m=2000000" "c2m-ttt3 1 $v31 $m=2000000 --set train.ttt_steps=3" \
        "c0.7m-e6 0 $v31 $m=700000 --set train.epochs=6" \
        "c2m-2gpu 0,1 $v31 $m=2000000 --set train.pack_tokens=16384" ;;
    ttt3) printf '%s\n' "t3-10m 0 $v31 --set train.ttt_steps=3" ;;  # §9b's recipe with TTT 3 (§10b's best change)
    ttt3x2) printf '%s\n' "t3-2x 0 $v31 --set train.ttt_steps=3 --set train.more_tokens=[$S/t07/tokens]" ;;  # + the T=0.7 pass
  esac | while read -r name rest; do
    [[ -z ${ONLY:-} || " $ONLY " == *" $name "* ]] && echo "$name $rest"
  done
}
NAMES=$(runs | cut -d' ' -f1 | tr '\n' ' ')
metrics_summary() {  # metrics_summary FILE NAME: one run's metrics.jsonl in a line. The medians leave out the
                    # first 10-step window (it holds the compile); the loss of every window (first and last if > 12)
  $PY - "$1" "$2" << 'PYEOF'
import json, statistics as st, sys
r = [json.loads(line) for line in open(sys.argv[1])]
w = [x for x in r if "tokens_per_s" in x]
m = w[1:] or w
phases = {k: round(st.median(x["phase_s"][k] for x in m if x.get("phase_s")), 4) for k in (m[-1].get("phase_s") or {})}
print(sys.argv[2], "steps", r[-1]["step"], "tok/s median", round(st.median(x["tokens_per_s"] for x in m)),
      "online share", round(st.median(x.get("online_share", 0) for x in m), 3), "loss per window", [round(x["loss"], 3) for x in (w if len(w) <= 12 else (w[0], w[-1]))],
      "phase_s median", phases, "elapsed_s", round(r[-1].get("elapsed_s", 0)), "first record at", round(r[0].get("elapsed_s", 0)),
      "heldout (step, tau, s)", [(x["step"], round(x["heldout_tau"], 3), round(x.get("heldout_s", 0), 1)) for x in r if x.get("heldout_tau")])
PYEOF
}
train() {
  say "train: $NAMES(RUNS=${RUNS:-${PAIR:-layout}}), online, packed, side by side"
  local name gpu sets i=0 pids=()
  while read -r name gpu sets; do
    # shellcheck disable=SC2086
    train_one "$name" "$gpu" $((29501 + i++)) $sets &
    pids+=($!)
  done < <(runs)
  (( ${#pids[@]} )) && wait "${pids[@]}"  # its own runs only: s9 has GPU 1's work running beside it, which waits for this (RESULTS §12)
  for n in $NAMES; do
    cp "$S/$n/train/metrics.jsonl" "$L/metrics-$n.jsonl" 2>/dev/null
    cp "$S/$n/train/data.json" "$L/data-$n.json" 2>/dev/null
    grep -h "start-up:" "$L/train-$n.log" | sed "s/^/$n /"
    metrics_summary "$L/metrics-$n.jsonl" "$n"
  done
  touch "$L/.train-done"
}
eval_one() {  # eval_one NAME SET CHECKPOINT GPU: offline tau of one export, in a run folder of its own (RUN/eval)
  local n=$1 set=$2 ck=$3 dir=$S/ev-$1-$2
  mkdir -p "$dir" "$S/$n/eval" && ln -sfn "$S/eval-$set/features" "$dir/features"
  CUDA_VISIBLE_DEVICES=$4 OMP_NUM_THREADS=2 $PY eval/offline/accept_len.py --config $CONFIG --run-dir "$dir" "${BASE[@]}" \
    --set "eval.checkpoint=$S/$n/$ck" --set eval.steps=5 > "$L/eval-$n-$set-$ck.txt" 2>&1
  cp "$dir/eval/accept_len.json" "$L/accept_len-$n-$set-$ck.json" 2>/dev/null
  cp "$dir/eval/accept_len.json" "$S/$n/eval/accept_len-$set.json" 2>/dev/null  # benchmarks/tau_curve.py reads these
  echo "$n $ck $set: $($PY -c "import json,sys; print({k: (round(v['tau'], 3), round(v.get('tau_walk', 0), 3)) for k, v in json.load(open(sys.argv[1]))['settings'].items()}, '(every root, cycle walk)')" "$L/accept_len-$n-$set-$ck.json" 2>&1)"
}
evaluate() {  # offline tau (chain 1/1/2 .. 5/1/6) of each drafter's best export on each held-out set, 6 at a time
  local n set ck i=0 pids=()
  say "offline tau: $NAMES"
  for n in $NAMES; do
    ck=export-best; [[ -d $S/$n/$ck ]] || ck=export  # the best by held-out tau; the last only when there is no best
    [[ -d $S/$n/$ck ]] || { echo "$n: no export"; continue; }
    for set in mtbench humaneval; do
      if (( ${#pids[@]} >= 6 )); then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
      eval_one "$n" "$set" "$ck" "${EVAL_GPU:-$((i++ % 2))}" &
      pids+=($!)
    done
  done
  (( ${#pids[@]} )) && wait "${pids[@]}"  # its own evaluations only (see train)
}
