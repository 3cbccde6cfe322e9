#!/usr/bin/env bash
# Issue 16 on `nvidia-h200-x2`: the Kimi-K2-shaped drafter (real dims, synthetic features) through
# `accelerate launch train/finetune.py`, unchanged code, on 1 and 2 GPUs under ZeRO-2 and ZeRO-3.
#   bash benchmarks/leases/k2_multi_gpu.sh setup            install the carried wheels ($C/p1/deps) and this tree into /tmp
#   bash benchmarks/leases/k2_multi_gpu.sh k2 OUT_DIR       synthetic store, estimate, runs z2-1gpu z2-2gpu z3-2gpu, then a
#                                               2-rank checkpoint resumed on 2 ranks and on 1 rank
#   bash benchmarks/leases/k2_multi_gpu.sh steps OUT_DIR    issues 16 and 18 after the loader and optimizer work (RESULTS §11):
#                                               NCCL bandwidth; on GPU 0 the 1-GPU runs (default, num_workers 0,
#                                               train.compile, seq 4096) while GPU 1 runs the side-by-side with
#                                               SpecForge (benchmarks/train_speed/train_speed.sh, carry .whl-specforge) and the
#                                               17-step compile check; then the same runs on 2 GPUs; the summary
#   bash benchmarks/leases/k2_multi_gpu.sh mem OUT_DIR      peak memory against the estimate at SEQ on 2 GPUs, eager and compiled
#   bash benchmarks/leases/k2_multi_gpu.sh start steps OUT_DIR   the same in a new process session (log OUT_DIR.log); `wait SECS
#                                               OUT_DIR` waits for it and prints the log's tail
#   bash benchmarks/leases/k2_multi_gpu.sh summary OUT_DIR  one line per run: tokens/s (total, per GPU), s/step, peak GiB, phases
# Env: C (carried files, /tmp/c), K2 (the run folder, /tmp/k2), STEPS (optimizer steps per run, 20), SEQ (2048).
set -uo pipefail
cd "$(dirname "$0")/../.."
C=${C:-/tmp/c}
K2=${K2:-/tmp/k2}
STEPS=${STEPS:-20}
SEQ=${SEQ:-2048}
export PYTHONPATH=/tmp/deps:/tmp/eagle3ft-site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 WANDB_MODE=disabled
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # KINDS.md: never multicast

sets() {  # sets STAGE_JSON: the overrides every K2 run shares
  echo --set "target.path=$K2/run/target" --set target.kind=hf --set target.name=synthetic-k2 \
    --set drafter.config=configs/drafters/kimi-k2.json --set drafter.init=null \
    --set train.ttt_steps=7 --set train.micro_batch_size=1 --set train.grad_accum=1 --set "train.max_len=$SEQ" --set train.warmup_steps=2 \
    --set train.wandb_mode=disabled --set train.keep_checkpoints=4 --set "train.deepspeed=configs/deepspeed/$1.json"
}
launch() {  # launch NAME ACCEL ZERO RUN_DIR [more args]: one training launch, its log in $OUT_DIR/NAME.log
  local name=$1 accel=$2 zero=$3 run=$4; shift 4
  echo "== $name ($(date +%T))"
  # shellcheck disable=SC2046
  accelerate launch --config_file "configs/accelerate/$accel.yaml" --main_process_port $((29500 + RANDOM % 1000)) \
    train/finetune.py --config configs/kimi-k25-8gpu.yaml --run-dir "$run" $(sets "$zero") "$@" > "$OUT_DIR/$name.log" 2>&1
  echo "   exit $? ($(date +%T)); $(grep -c '"step"' "$run/train/metrics.jsonl" 2>/dev/null) metric records"
  cp "$run/train/metrics.jsonl" "$OUT_DIR/$name.metrics.jsonl" 2>/dev/null
}
fresh_run() {  # fresh_run DIR: a run folder over the shared synthetic features
  rm -rf "$1" && mkdir -p "$1" && ln -s "$K2/run/features" "$1/features" && cp "$K2/run/vocab.safetensors" "$1/"
}

SECTION7D=(--set train.compile=false --set train.num_workers=0)  # the k2 phase's runs as RESULTS §7d ran them
one() {  # one NAME ACCEL RUN_FOLDER_ROOT [more args]: a fresh run over RUN_FOLDER_ROOT's features, STEPS steps, then gone
  local name=$1 accel=$2 root=$3; shift 3
  K2=$root fresh_run "$root/$name"
  K2=$root launch "$name" "$accel" "${ZERO:-zero2}" "$root/$name" --set "train.max_steps=$STEPS" --set train.save_every=100000 "$@"
  rm -rf "${root:?}/$name"
}

case ${1:-} in
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/deps "$C"/p1/deps/*.whl
    rm -rf /tmp/eagle3ft-site
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/eagle3ft-site . >/dev/null
    python3 -c "import torch, deepspeed, accelerate; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'accelerate', accelerate.__version__, 'gpus', torch.cuda.device_count())"
    ;;
  k2)
    OUT_DIR=${2:?OUT_DIR}; mkdir -p "$OUT_DIR"
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total,driver_version --format=csv > "$OUT_DIR/gpus.csv"
    nvidia-smi topo -m > "$OUT_DIR/topo.txt" 2>&1
    [[ -f $K2/run/features/manifest.json ]] || python3 benchmarks/k2_synthetic.py --run-dir "$K2/run" --samples $((STEPS * 2 + 8)) --seq "$SEQ"
    for g in 1 2; do python3 -m eagle3ft.train.estimate --drafter configs/drafters/kimi-k2.json --gpus $g --seq "$SEQ" --json > "$OUT_DIR/estimate-${g}gpu.json"; done
    fresh_run "$K2/z2-1"; CUDA_VISIBLE_DEVICES=0 launch z2-1gpu 1gpu zero2 "$K2/z2-1" "${SECTION7D[@]}" --set "train.max_steps=$STEPS" --set train.save_every=1000
    fresh_run "$K2/z2-2"; launch z2-2gpu 2gpu zero2 "$K2/z2-2" "${SECTION7D[@]}" --set "train.max_steps=$STEPS" --set "train.save_every=$((STEPS / 2))"
    fresh_run "$K2/z3-2"; launch z3-2gpu 2gpu zero3 "$K2/z3-2" "${SECTION7D[@]}" --set "train.max_steps=$STEPS" --set train.save_every=1000
    # resume the 2-rank checkpoint at STEPS/2 on 2 ranks and on 1 rank; the loss must continue as z2-2gpu's did
    for g in 2 1; do
      fresh_run "$K2/res-$g"; cp -r "$K2/z2-2/ckpt" "$K2/res-$g/"; rm -rf "$K2/res-$g/ckpt/step-$STEPS"
      if [[ $g == 1 ]]; then export CUDA_VISIBLE_DEVICES=0; fi
      launch "resume-2to$g" "${g}gpu" zero2 "$K2/res-$g" "${SECTION7D[@]}" --set "train.max_steps=$STEPS" --set train.save_every=1000 --resume auto
      unset CUDA_VISIBLE_DEVICES
    done
    bash "$0" summary "$OUT_DIR"
    ;;
  steps)
    OUT_DIR=${2:?OUT_DIR}; mkdir -p "$OUT_DIR"
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total,driver_version --format=csv > "$OUT_DIR/gpus.csv"
    nvidia-smi topo -m > "$OUT_DIR/topo.txt" 2>&1
    echo "== nccl ($(date +%T))"
    NCCL_DEBUG=INFO torchrun --nproc_per_node 2 --master_port 29444 benchmarks/nccl_bandwidth.py --out "$OUT_DIR/nccl.json" \
      > "$OUT_DIR/nccl.log" 2>&1; grep -E "via|bus_GBps|ms" "$OUT_DIR/nccl.log" | head -20
    K2_4K=${K2}-4k
    [[ -f $K2/run/features/manifest.json ]] || python3 benchmarks/k2_synthetic.py --run-dir "$K2/run" --samples $((STEPS * 2 + 8)) --seq "$SEQ"
    (K2=$K2_4K; [[ -f $K2/run/features/manifest.json ]] || python3 benchmarks/k2_synthetic.py --run-dir "$K2/run" --samples $((STEPS * 2 + 8)) --seq 4096 > "$OUT_DIR/k2-4k.log" 2>&1) &
    gen4k=$!
    for g in 1 2; do for q in "$SEQ" 4096; do
      python3 -m eagle3ft.train.estimate --drafter configs/drafters/kimi-k2.json --gpus $g --seq "$q" --json > "$OUT_DIR/estimate-${g}gpu-$q.json"
    done; done
    (  # GPU 1: issue 18, ours (default, compiled) against SpecForge side by side, then the compile check over 17 steps
      export CUDA_VISIBLE_DEVICES=1 PKGROOT=/tmp/eagle3ft-speed OUT=$OUT_DIR/speed
      RUNS=a A_ARGS="--variant topk+adam=fused --variant topk+adam=fused+compile --theirs flex_attention" \
        bash benchmarks/train_speed/train_speed.sh > "$OUT_DIR/speed.log" 2>&1
      PYTHONPATH=/tmp/eagle3ft-speed python3 benchmarks/compile_check.py --dims k2 --train-steps 17 \
        --out "$OUT_DIR/compile_check_k2.json" > "$OUT_DIR/compile_check_k2.log" 2>&1
      echo "   gpu1 done ($(date +%T))"
    ) &
    gpu1=$!
    export CUDA_VISIBLE_DEVICES=0
    one z2-1gpu 1gpu "$K2" --set train.compile=false
    one z2-1gpu-w0 1gpu "$K2" --set train.num_workers=0 --set train.compile=false
    one z2-1gpu-compile 1gpu "$K2" --set train.compile=true
    wait $gen4k
    one z2-1gpu-4k 1gpu "$K2_4K" --set train.max_len=4096 --set train.compile=false
    wait $gpu1
    unset CUDA_VISIBLE_DEVICES
    one z2-2gpu 2gpu "$K2" --set train.compile=false
    one z2-2gpu-w0 2gpu "$K2" --set train.num_workers=0 --set train.compile=false
    one z2-2gpu-4k 2gpu "$K2_4K" --set train.max_len=4096 --set train.compile=false
    ZERO=zero3 one z3-2gpu 2gpu "$K2" --set train.compile=false
    one z2-2gpu-compile 2gpu "$K2" --set train.compile=true
    bash "$0" summary "$OUT_DIR"
    echo "steps done ($(date +%T))"
    ;;
  mem)  # mem OUT_DIR: peak memory against the estimate at SEQ (8192) on 2 GPUs, ZeRO-2, eager and compiled (STEPS 6)
    OUT_DIR=${2:?OUT_DIR}; mkdir -p "$OUT_DIR"; K2_SEQ=${K2}-$SEQ
    [[ -f $K2_SEQ/run/features/manifest.json ]] || K2=$K2_SEQ python3 benchmarks/k2_synthetic.py --run-dir "$K2_SEQ/run" --samples $((STEPS * 2 + 4)) --seq "$SEQ"
    python3 -m eagle3ft.train.estimate --drafter configs/drafters/kimi-k2.json --gpus 2 --seq "$SEQ" --json > "$OUT_DIR/estimate-2gpu-$SEQ.json"
    for c in false true; do one "z2-2gpu-$SEQ-compile-$c" 2gpu "$K2_SEQ" --set "train.max_len=$SEQ" --set "train.compile=$c"; done
    bash "$0" summary "$OUT_DIR"
    echo "steps done ($(date +%T))"
    ;;
  start)  # start PHASE ARGS...: from a copy of this tree, in a new process session; the log beside OUT_DIR
    shift; tree=/tmp/tree-$(date +%s) && mkdir -p "$tree" && tar --exclude=./.git -cf - . | tar -xf - -C "$tree"
    (cd "$tree" && setsid nohup bash benchmarks/leases/k2_multi_gpu.sh "$@" > "${2:?OUT_DIR}.log" 2>&1 < /dev/null &)
    echo "started: $* (from $tree)" ;;
  wait)
    end=$((SECONDS + ${2:-60}))
    until grep -q "^steps done\|^usage" "${3:?OUT_DIR}.log" 2> /dev/null || (( SECONDS >= end )); do sleep 5; done
    tail -40 "$3.log" ;;
  summary)
    OUT_DIR=${2:?OUT_DIR}
    python3 - "$OUT_DIR" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("*.metrics.jsonl")):
    recs = [json.loads(l) for l in f.read_text().splitlines() if l.strip()]
    if not recs:
        continue
    name = f.name.split(".")[0]
    world = len(recs[-1]["samples"])
    steady = recs[3:] or recs
    tok_s = statistics.median(r["tokens_per_s"] for r in steady)
    rows[name] = {"world": world, "steps": [recs[0]["step"], recs[-1]["step"]], "tok_s": tok_s, "tok_s_per_gpu": tok_s / world,
                  "tok_s_min_max": [min(r["tokens_per_s"] for r in steady), max(r["tokens_per_s"] for r in steady)],
                  "s_per_step": statistics.median(r["s_per_step"] for r in steady),
                  "max_mem_gib": max((r.get("max_mem_gib") or 0) for r in recs),
                  "phase_ms": {k: round(1e3 * statistics.median(r["phase_s"][k] for r in steady), 1)
                               for k in (steady[0].get("phase_s") or {})},
                  "loss": {r["step"]: round(r["loss"], 5) for r in recs}}
for k in rows:  # z2-2gpu-X against z2-1gpu-X (the same variant on one GPU); ZeRO-3 against ZeRO-2's one GPU
    one = k.replace("z3-2gpu", "z2-1gpu").replace("-2gpu", "-1gpu")
    if rows[k]["world"] == 2 and one != k and one in rows:
        rows[k]["scaling_efficiency_vs_" + one.replace("-", "_")] = rows[k]["tok_s"] / (2 * rows[one]["tok_s"])
for k in ("resume-2to2", "resume-2to1"):
    if k in rows and "z2-2gpu" in rows:
        ref = rows["z2-2gpu"]["loss"]
        rows[k]["max_abs_loss_diff_vs_straight"] = max((abs(v - ref[s]) for s, v in rows[k]["loss"].items() if s in ref), default=None)
(out / "summary.json").write_text(json.dumps(rows, indent=1))
for k, r in rows.items():
    print(k, {x: (round(v, 3) if isinstance(v, float) else v) for x, v in r.items() if x != "loss"})
EOF
    ;;
  *) echo "usage: $0 setup | k2 OUT_DIR | summary OUT_DIR" >&2; exit 2 ;;
esac
