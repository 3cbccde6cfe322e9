# Sourced by benchmarks/leases/run_phases.sh: the plain regeneration servers (start, place, wait, stop), their decode rates,
# and data/regen.py through them.
mem_fraction() {  # mem_fraction SHARE SLOT: SGLang's --mem-fraction-static for the SLOT-th server started on a GPU
  # (from 0), each started once the one before is up, so that each gets SHARE of the GPU: SGLang 0.5.17 takes the
  # fraction of the memory still free when the server starts, and two servers starting together fail at random
  # ("Loaded weights leave no GPU memory for the KV cache", RESULTS §13)
  awk -v s="$1" -v k="$2" 'BEGIN { printf "%.3f", s / (1 - k * s) }'
}
server_start() {  # server_start J BACKEND: plain server J on GPU GPU_BASE + J / PER_GPU, port 30000+J (PER_GPU servers share a GPU)
  local j=$1 k=${PER_GPU:-1} gpu=$((${GPU_BASE:-0} + $1 / ${PER_GPU:-1})) running graph_bs
  running=$((${RUNNING:-1024} / k))  # requests each server runs at once; its decode CUDA graphs cover them all
  graph_bs=$(( running > 512 ? (running + 31) / 32 * 32 : 512 ))
  if [[ -n ${SERVER_CMD:-} ]]; then
    $PY $SERVER_CMD --model-path "$MODEL" --port $((30000 + j)) --skip-tokenizer-init > "$L/server$j.log" 2>&1 &
  else
    CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=$SGL_DIR SGLANG_ENABLE_JIT_DEEPGEMM=0 $PY -m sglang.launch_server --model-path "$MODEL" \
      --host 127.0.0.1 --port $((30000 + j)) --attention-backend "$2" --sampling-backend pytorch \
      --mem-fraction-static "$(mem_fraction "$(awk -v k="$k" 'BEGIN { printf "%.4f", 0.85 / k }')" $((j % k)))" \
      --cuda-graph-max-bs-decode "$graph_bs" --max-running-requests "$running" --skip-tokenizer-init --cuda-graph-backend-prefill disabled \
      "${PRIO_ARGS[@]}" "${SERVER_EXTRA_ARGS[@]}" > "$L/server$j.log" 2>&1 &
  fi
  PIDS[j]=$!
  echo "server $j on GPU $gpu: $2 (pid ${PIDS[j]})"
}
server_placed() {  # server_placed I: server I has its KV pool (SGLang logs "Memory pool end"), or is up; the next
                   # server on its GPU can then start (RESULTS §13: one that measures the free memory before this one's
                   # pool is allocated fails), while this one still captures its CUDA graphs
  local i=$1 end=$((SECONDS + 600))
  until grep -q "Memory pool end" "$L/server$i.log" 2> /dev/null || curl -sf "${URLS[i]}/health" > /dev/null; do
    (( SECONDS < end )) && kill -0 "${PIDS[i]}" 2> /dev/null || return 0  # server_wait reports it
    sleep 1
  done
}
server_wait() {  # server_wait I: server I healthy within 10 min; a server of another backend than triton that is not up
                 # within ATTN_WAIT_S is restarted with triton
  local i=$1 end=$((SECONDS + 600)) fallback_at=$((SECONDS + ${ATTN_WAIT_S:-420}))
  until curl -sf "${URLS[i]}/health" > /dev/null; do
    (( SECONDS < end )) || { echo "server ${URLS[i]} did not come up"; tail -20 "$L"/server*.log; return 1; }
    if [[ ${BACKENDS[i]} == triton ]] && ! kill -0 "${PIDS[i]}" 2> /dev/null; then
      echo "server $i exited before it was up"; tail -20 "$L/server$i.log"; return 1
    fi
    if [[ ${BACKENDS[i]} != triton ]] && { ! kill -0 "${PIDS[i]}" 2> /dev/null || (( SECONDS > fallback_at )); }; then
      echo "server $i (${BACKENDS[i]}) not up: restarting it with triton"; tail -5 "$L/server$i.log"
      kill "${PIDS[i]}" 2> /dev/null; sleep 3; mv "$L/server$i.log" "$L/server$i-${BACKENDS[i]}-failed.log"
      BACKENDS[i]=triton; server_start "$i" triton
    fi
    sleep 2
  done
}
servers_up() {  # servers_up: PER_GPU plain servers per GPU (1) on NGPU GPUs (all) from GPU_BASE (0), healthy within 10 min;
                # the next server on a GPU starts once the one before has its KV pool (server_placed, mem_fraction)
  local i n slot k=${PER_GPU:-1} attn
  n=${NGPU:-$($PY -c "import torch; print(max(1, torch.cuda.device_count()))" 2>/dev/null || echo 1)}
  n=$((n * k))
  IFS=, read -r -a attn <<< "${ATTN:-triton}"
  URLS=() PIDS=() BACKENDS=()
  for ((i = 0; i < n; i++)); do
    URLS+=("http://127.0.0.1:$((30000 + i))")
    BACKENDS[i]=${attn[i]:-${attn[-1]}}
  done
  local t0=$SECONDS
  for ((slot = 0; slot < k; slot++)); do
    for ((i = slot; i < n; i += k)); do server_start "$i" "${BACKENDS[i]}"; done
    for ((i = slot; i < n; i += k)); do server_placed "$i"; done
  done
  for ((i = 0; i < n; i++)); do server_wait "$i" || return 1; done
  echo "servers up after $((SECONDS - t0)) s"
  printf '%s\n' "${PIDS[@]}" > "$L/server.pids"
  echo "servers up: ${URLS[*]} (attention: ${BACKENDS[*]})"
}
gen_throughput() {  # the servers' own decode rates, from their logs: median and p90 per server, then the GPU's sum in
                    # 10-s windows (benchmarks/decode_windows.py)
  local f logs=()
  for f in "$L"/server[0-9].log "$L"/server[0-9][0-9].log; do [[ -f $f ]] && logs+=("$f"); done
  (( ${#logs[@]} )) && $PY benchmarks/decode_windows.py "${logs[@]}"
}
servers_down() {  # the servers of servers_up, also when it gave up before they were all healthy
  [[ -f $L/server.pids ]] && xargs -r kill < "$L/server.pids"
  kill "${PIDS[@]:-}" 2> /dev/null; rm -f "$L/server.pids"; sleep 5
}
regen_run() {  # regen_run RUN_DIR SOURCES [sets...]: data/regen.py through the servers
  local joined
  joined=$(IFS=,; echo "${URLS[*]}")
  timeout -s INT "${REGEN_S:-360}" $PY data/regen.py --config $CONFIG --run-dir "$1" "${BASE[@]}" "${GEN[@]}" \
    --set harvest.backend=sglang --set "harvest.sglang.urls=[${joined//,/, }]" \
    --set "harvest.sglang.concurrency=${SETTING%x*}" --set "harvest.sglang.prompts_per_request=${SETTING#*x}" \
    --set "harvest.sources=$2" "${@:3}"
}
