#!/usr/bin/env bash
# Issue 41 item 10: how often does a 2-process ZeRO-3 CPU launch of train/finetune.py lose a rank at exit
# ("terminate called without an active exception", SIGABRT)? Runs the launch of
# tests/test_train_loop.py::test_zero3_trains_like_zero2_and_exports_whole_weights N times (default 50) and counts
# the launches that printed 'terminate called' or exited non-zero. LOAD=1 runs a busy loop alongside (the 2-core CI
# machine is shared), which makes the race likelier.
#   bash benchmarks/leases/exit_abort_loop.sh [N]       (from the repository root; LOAD=1 for a loaded CPU)
set -u
export PYTHONFAULTHANDLER=${PYTHONFAULTHANDLER:-1}  # an aborting rank prints every Python thread's stack
N=${1:-50}
cd "$(dirname "$0")/../.."
[ "${CORE:-0}" = 1 ] && ulimit -c unlimited  # CORE=1: an aborting rank leaves ./core (for gdb)
PY=${PY:-.venv/bin/python}
work=$(mktemp -d)
trap 'kill "${busy:-}" 2>/dev/null; rm -rf "$work"' EXIT
"$PY" -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from train_fixtures import write_store; write_store(Path(sys.argv[1]))" "$work/base"
if [ "${LOAD:-0}" = 1 ]; then
  (while :; do :; done) &
  busy=$!
fi
aborts=0 fails=0
for i in $(seq 1 "$N"); do
  run="$work/run-$i"
  cp -r "$work/base" "$run"
  mapfile -t cmd < <("$PY" -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from train_fixtures import launch_cmd; print('\n'.join(launch_cmd(Path(sys.argv[1]), 'train.max_steps=6', 'train.warmup_steps=2', 'train.lr=3e-3', 'train.save_every=2', 'train.keep_checkpoints=2', 'train.ttt_steps=3', 'train.deepspeed=configs/deepspeed/zero3.json')))" "$run")
  t0=$SECONDS
  "${cmd[@]}" >"$run.out" 2>"$run.err"
  rc=$?
  tag=ok
  if grep -q "terminate called" "$run.err"; then aborts=$((aborts + 1)); tag=ABORT; fi
  if [ "$rc" != 0 ]; then fails=$((fails + 1)); [ "$tag" = ok ] && tag=FAIL; fi
  echo "run $i/$N: rc=$rc $tag ($((SECONDS - t0)) s)"
  if [ "$tag" != ok ]; then
    mkdir -p "${KEEP:-/tmp/exit_abort_loop}"
    cp "$run.err" "${KEEP:-/tmp/exit_abort_loop}/run-$i.err"
    grep -n "terminate called\|Error\|Signal\|exitcode" "$run.err" | head -5
    [ -f core ] && mv core "${KEEP:-/tmp/exit_abort_loop}/core-$i"
  fi
  rm -rf "$run" "$run.out" "$run.err"
done
echo "aborts ('terminate called'): $aborts of $N; non-zero exits: $fails of $N (LOAD=${LOAD:-0})"
