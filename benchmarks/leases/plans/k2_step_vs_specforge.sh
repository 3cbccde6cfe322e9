#!/usr/bin/env bash
# Issue 18 on one H200, after a change to the K2 step: the side-by-side again (ours, the defaults, against SpecForge
# 0.2.0 flex_attention; 8 rounds), then `make test-gpu` and the per-tensor compile check at K2 dims.
#   run(command="bash benchmarks/leases/plans/k2_step_vs_specforge.sh", carry=[".whl-specforge", ".carry/p1", ".carry/tokhf"])
# Files back in $OUT/r2: speed.log and train_speed's files, test-gpu.log, compile_check_k2.{txt,json}.
set -u
cd "$(dirname "$0")/../../.."
mkdir -p "$OUT/r2"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/deps .carry/p1/deps/*.whl 2>&1 | tail -2
mkdir -p /tmp/c && rm -rf /tmp/c/tokhf && cp -r .carry/tokhf /tmp/c/tokhf
RUNS=a OUT=$OUT/r2 A_ARGS="--rounds 8 --budget-s 110 --variant topk+adam=fused+compile --theirs flex_attention" \
  timeout 230 bash benchmarks/train_speed/train_speed.sh > "$OUT/r2/speed.log" 2>&1
echo "speed exit $?"; grep -A6 "^## train step" "$OUT/r2/speed.log"
EAGLE3FT_TINY_TOKENIZER=/tmp/c/tokhf PYTHONPATH=/tmp/deps timeout 240 make test-gpu > "$OUT/r2/test-gpu.log" 2>&1
echo "test-gpu exit $?"; tail -8 "$OUT/r2/test-gpu.log"
PYTHONPATH=/tmp/eagle3ft-site PYTHONSAFEPATH=1 timeout 150 python3 benchmarks/compile_check.py --dims k2 --seq 1024 \
  --emulate --train-steps 5 --out "$OUT/r2/compile_check_k2.json" > "$OUT/r2/compile_check_k2.txt" 2>&1
echo "cc exit $?"; tail -25 "$OUT/r2/compile_check_k2.txt"
