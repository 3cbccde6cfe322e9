#!/usr/bin/env bash
# Drafter train-step speed on the H200: eagle3ft against SpecForge 0.2.0 (benchmarks/train_speed/train_speed.py).
#
# Device call (one H200, ~2 x 2.5 min; see benchmarks/train_speed/NOTES-train-speed.md):
#   run(command="bash benchmarks/train_speed/train_speed.sh", carry=[".whl-specforge"], timeout_s=420)
# Two processes, each with the GPU to itself (RUNS=a or RUNS=b for one of them, <= 150 s each):
#   a  headline: ours (fused AdamW; the attn=lse side is the fallback should the flash path fail on the device)
#      vs SpecForge flex_attention (its default)
#   b  our variants: the pre-speed-work unroll (baseline) vs the new default, minus the flash merge (attn=lse),
#      plus fused AdamW, plus torch.compile (train.compile)
# Files back in $OUT: train_speed_{a,b}.json, train_speed_{a,b}.log, profile_{a,b}.txt.
# Arguments replace run b's variants (e.g. --variant topk --variant topk+head_chunk=4096); RUNS=a runs a alone;
# A_ARGS replaces run a's sides; COMMON is added to both (the CPU check: COMMON="--tiny" A_ARGS="--theirs sdpa").
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=${WHEELS:-.whl-specforge}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-benchmarks/out}
RUNS=${RUNS:-a b}
A_ARGS=${A_ARGS:---variant topk+adam=fused --variant topk+adam=fused+attn=lse --theirs flex_attention}
COMMON=${COMMON:-}
mkdir -p "$OUT"

ls "$WHEELS"/*.whl >/dev/null 2>&1 || { echo "no wheels in $WHEELS: name it in the run's carry" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
# eagle3ft from this working tree (a plain, non-editable install beside the wheels); a warm machine may still hold
# an earlier tree's copy, which pip --target would keep
PKGROOT=${PKGROOT:-/tmp/eagle3ft-site}
rm -rf "$PKGROOT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$PKGROOT" . >/dev/null
export PYTHONPATH="$SITE:$PKGROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1  # the repo root's eagle3ft/ must not shadow the installed package
python3 -c "import specforge.algorithms.eagle3.model, eagle3ft.train.attention as t; print('imports ok:', t.__file__, 'ATTENTION =', t.ATTENTION)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.used,memory.total,driver_version --format=csv || true

if [[ " $RUNS " == *" a "* ]]; then
  # shellcheck disable=SC2086
  python3 benchmarks/train_speed/train_speed.py --tag a --out "$OUT" --profile --budget-s 100 $A_ARGS $COMMON 2>&1 \
    | tee "$OUT/train_speed_a.log" \
    || echo "run a failed (exit ${PIPESTATUS[0]})"
fi
if [[ " $RUNS " == *" b "* ]]; then
  if [[ $# -gt 0 ]]; then args=("$@"); else
    args=(--variant topk+baseline --variant topk --variant topk+attn=lse --variant topk+adam=fused
          --variant topk+adam=fused+compile)
  fi
  # shellcheck disable=SC2086
  python3 benchmarks/train_speed/train_speed.py --tag b --out "$OUT" --profile --budget-s 90 --theirs none "${args[@]}" $COMMON 2>&1 \
    | tee "$OUT/train_speed_b.log" || echo "run b failed (exit ${PIPESTATUS[0]})"
fi
