# Sourced by benchmarks/leases/run_phases.sh: the phases that combine the others in one lease (regenspeed, s9, onoff,
# resume_ws, curve) and wait_for.
regenspeed() {  # issue 13.1: PER_GPU (2) plain servers on GPU SPEED_GPU (1) alone; benchmarks/regen_speed.py's
                # SPEED_SETTINGS on the same SPEED_CONVS ShareGPT conversations (every turn), prefix cache flushed between
  local per=${PER_GPU:-2} u args=()
  say "regen speed: $per servers on GPU ${SPEED_GPU:-1}, settings ${SPEED_SETTINGS:-512x1,128x8}, ${SPEED_CONVS:-3000} conversations"
  wait_for 900 "$SGL_DIR/.ready"
  PER_GPU=$per GPU_BASE=${SPEED_GPU:-1} NGPU=1 servers_up || { servers_down; return 1; }
  for u in "${URLS[@]}"; do args+=(--url "$u"); done
  timeout 600 $PY benchmarks/regen_speed.py --config $CONFIG "${args[@]}" --conversations "${SPEED_CONVS:-3000}" \
    --max-turns 1000 --max-new-tokens "${MAX_NEW:-1024}" --settings "${SPEED_SETTINGS:-512x1,128x8}" --out "$S/regen-speed" \
    "${BASE[@]}" --set "harvest.sources=[{kind: sharegpt, path: $DATA/sharegpt-prompts.json, limit: ${SPEED_CONVS:-3000}}]" \
    --set harvest.shard_samples=256 2> "$L/regen-speed.log"
  echo "exit $?"; tail -3 "$L/regen-speed.log"
  cp "$S/regen-speed/regen_speed.json" "$L/" 2>/dev/null
  gen_throughput | tee "$L/regen-speed-gen-throughput.txt"
  servers_down
}
s9() {  # issues 13 and 14 in one lease, both GPUs busy: GPU 0 trains T3 (RUNS=ttt3), its offline tau, then the SGLang
        # calibrated prediction; GPU 1 the held-out features, the embedded calibration, the regen speed, then the
        # embedded prediction and measurement of T3 (CAL_NEW short, NEW long answers)
  local t3=$S/${T3:-t3-10m}/export-best
  regen || return 1
  ( HELD_GPU=1 heldout > "$L/heldout.txt" 2>&1; touch "$L/.heldout-done"
    embedded_step cal "$SHIPPED" "$t3"
    regenspeed > "$L/regenspeed.txt" 2>&1; cat "$L/regenspeed.txt"
    DRAFTER_READY=$L/.t3-ready embedded_step test "$SHIPPED" "$t3" ) > "$L/gpu1.txt" 2>&1 &
  train
  wait_for 600 "$L/.heldout-done"; cat "$L/heldout.txt" 2>/dev/null
  EVAL_GPU=0 evaluate
  touch "$L/.t3-ready"  # also when training failed: GPU 1's measurement then stops at once instead of waiting
  SGL_GPU=0 sglpred "$SHIPPED" "$t3" > "$L/sglpred.txt" 2>&1; cat "$L/sglpred.txt"
  wait; cat "$L/gpu1.txt"
}
onoff() {  # issue 13.2: offline against online training, the same samples and steps, one GPU: ONOFF_CONVS conversations of
           # the carried TOKENS harvested into a feature store (bf16 aux states), then the same drafter trained from it
           # and from the target's prefill per batch (online, on the store's own tokens), ONOFF_STEPS steps each;
           # ONOFF_RUNS lists the trainings as mode:ttt_steps ("offline:3 online:3")
  local run=$S/onoff-offline r mode ttt n
  [[ -d $S/main/tokens ]] || regen
  say "online vs offline: the features of ${ONOFF_CONVS:-600} conversations"
  CUDA_VISIBLE_DEVICES=0 $PY data/harvest.py --config $CONFIG --run-dir "$run" "${BASE[@]}" "${GEN[@]}" --set harvest.batch_size=64 \
    --set "harvest.sources=[{kind: tokens, path: $S/main/tokens, split: train, limit: ${ONOFF_CONVS:-600}}, {kind: tokens, path: $S/main/tokens, split: heldout, limit: 16}]" \
    > "$L/onoff-harvest.json" 2> "$L/onoff-harvest.log"
  echo "harvest exit $?"; grep -h '"time_s"\|"tokens"' "$L/onoff-harvest.json" | tail -3; du -sh "$run/features"
  for r in ${ONOFF_RUNS:-offline:3 online:3}; do
    mode=${r%:*} ttt=${r#*:} n=$S/onoff-${r/:/-t}
    mkdir -p "$n" && ln -sfn "$run/features" "$n/features" && ln -sfn "$run/vocab.safetensors" "$n/vocab.safetensors"
    CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=2 timeout -s INT "${ONOFF_S:-240}" accelerate launch --config_file configs/accelerate/1gpu.yaml \
      --main_process_port 29511 train/finetune.py --config $CONFIG --run-dir "$n" "${BASE[@]}" --set "train.features=$mode" \
      --set "train.pack_tokens=${PACK:-32768}" --set train.max_len=4096 --set "train.max_steps=${ONOFF_STEPS:-60}" --set train.eval_every=0 \
      --set "train.lr=${LR:-2e-3}" --set train.warmup_steps=10 --set train.save_every=100000 --set train.log_every=10 \
      --set drafter.fc_norm=true --set drafter.norm_output=true --set "train.ttt_steps=$ttt" > "$L/train-onoff-${r/:/-t}.log" 2>&1
    echo "$r exit $?"; grep -h "start-up:\|first step" "$L/train-onoff-${r/:/-t}.log" | tr '\r' '\n' | grep -v '^train:'
    cp "$n/train/metrics.jsonl" "$L/metrics-onoff-${r/:/-t}.jsonl" 2> /dev/null
    metrics_summary "$L/metrics-onoff-${r/:/-t}.jsonl" "$r"
  done
}
resume_ws() {  # issue 16: a checkpoint of 2 ranks resumed on 2 and on 1, on the GPUs (ZeRO-2 and ZeRO-3)
  say "resume across world sizes on the GPUs"
  OMP_NUM_THREADS=2 timeout 900 $PY benchmarks/resume_world_size.py --out "$S/resume-ws" --accelerate configs/accelerate/2gpu.yaml \
    --zero zero2 zero3 --set "target.tokenizer=$MODEL" --set target.gguf_file=null > "$L/resume-ws.txt" 2>&1
  echo "resume exit $?"; tail -4 "$L/resume-ws.txt"; cp "$S/resume-ws/resume_world_size.json" "$L/" 2>/dev/null
}
curve() {
  regen || return 1
  heldout > "$L/heldout.txt" 2>&1 &
  local held=$!
  sgl_up > "$L/sgl-up.txt" 2>&1 &
  resume_ws > "$L/resume-phase.txt" 2>&1 &
  train
  wait $held; cat "$L/heldout.txt"
  evaluate
  embedded "$S/c0.7m/export-best"
  wait_for 600 "$L/.sgl-up"; cat "$L/sgl-up.txt"
  sgl_bench
  wait; cat "$L/resume-phase.txt"
}
wait_for() { local end=$((SECONDS + $1)); until [[ -f $2 ]] || (( SECONDS >= end )); do sleep 3; done; }
