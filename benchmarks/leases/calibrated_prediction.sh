#!/usr/bin/env bash
# Issue 14.6 on the embedded backend: the economics predict, not restate. One bench run with a calibration drafter
# (any drafter) measures the cycle cost of each setting; the drafter under test then gets its live tok/s predicted
# from its offline tau alone (RUN/bench/prediction.json, written before its own bench exists), and only then is it
# benched on the same prompts and settings. eval/economics/analysis.py puts prediction and measurement side by side.
#   bash benchmarks/leases/calibrated_prediction.sh OUT_DIR [CALIBRATION_DRAFTER] [DRAFTER]
# Defaults: the calibration drafter is runs/demo-s5/export if present (a weak one: its tau does not matter, only its
# costs), the drafter under test drafters/smollm2-135m. Prompts: MT-Bench questions, held out; sizes below.
# Env: N_PROMPTS (6), NEW (new tokens, 64), CAL_NEW (the calibration bench's new tokens, NEW: where launches bound a
# cycle, its cost does not depend on the answer's length, so a short calibration can price long answers), REPS (3),
# SETTINGS (steps/topk/draft tokens, comma-separated: 1/1/2,2/1/3,3/1/4,5/1/6), MTBENCH (the questions' file where the
# package is not installed), SOURCE (the prompts as a source's fields instead, e.g. "kind: humaneval, limit: 6"),
# CAL_SOURCE (the calibration run's prompts as a source's fields, SOURCE's by default: costs measured on other prompts
# than the ones predicted, so that the calibration may bench the drafter under test itself),
# EXTRA (more --set pairs, e.g. the target's path on a GPU machine), PY (python),
# DRAFTER_READY (a file to wait for, up to 20 min, before the drafter under test is read: it may still be training
# while the calibration runs), STEPS (all; features: the held-out features only; cal: the features, unless an earlier
# `features` made them, and the calibration run; test: the prediction and the measurement only, from an OUT_DIR where
# `cal` ran).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: $0 OUT_DIR [CALIBRATION_DRAFTER] [DRAFTER]}
CAL_DRAFTER=${2:-runs/demo-s5/export}
DRAFTER=${3:-drafters/smollm2-135m}
CONFIG=configs/smollm2-135m.yaml
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
PY=${PY:-python}
SRC=${SOURCE:-"kind: mtbench, limit: ${N_PROMPTS:-6}${MTBENCH:+, path: $MTBENCH}"}
SETTING_LIST=""
DEPTH=5  # offline tau is evaluated to the deepest setting's chain, and at least to 5/1/6
IFS=, read -r -a settings <<< "${SETTINGS:-1/1/2,2/1/3,3/1/4,5/1/6}"
for s in "${settings[@]}"; do
  IFS=/ read -r st tk nd <<< "$s"
  SETTING_LIST+="${SETTING_LIST:+, }{steps: $st, topk: $tk, num_draft_tokens: $nd}"
  (( st > DEPTH )) && DEPTH=$st
done
read -r -a EXTRA_SETS <<< "${EXTRA:-}"
SETS=(
  "${EXTRA_SETS[@]}"
  --set "harvest.sources=[{$SRC, split: heldout}]"
  --set harvest.max_turns=1 --set harvest.max_new_tokens=${NEW:-64} --set harvest.max_total_tokens=$((${NEW:-64} + 2048))
  --set harvest.batch_size=6 --set harvest.shard_samples=32
  --set eval.steps=$DEPTH --set eval.num_draft_tokens=$((DEPTH + 1))
  --set "bench.prompts={$SRC}" --set bench.max_new_tokens=${NEW:-64}
  --set bench.repetitions=${REPS:-3} --set "bench.drafters={}" --set "bench.settings=[$SETTING_LIST]"
)
say() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

STEPS=${STEPS:-all}
[[ $STEPS == @(all|features|cal|test) ]] || { echo "STEPS=$STEPS: expected all, features, cal or test" >&2; exit 2; }
if [[ $STEPS != test ]]; then
  if [[ $STEPS == features || ! -s $OUT/harvest.json ]]; then
    say "held-out features of the bench's prompts (the target's own answers)"
    $PY data/harvest.py --config "$CONFIG" --run-dir "$OUT/calibrate" "${SETS[@]}" > "$OUT/harvest.json.partial"
    mv "$OUT/harvest.json.partial" "$OUT/harvest.json"
    mkdir -p "$OUT/test" && ln -sfn "$(cd "$OUT/calibrate" && pwd)/features" "$OUT/test/features"
  fi
  [[ $STEPS != features ]] || exit 0

  say "calibration run: $CAL_DRAFTER, every setting, interleaved with plain decoding"
  CAL_SETS=(--set "bench.max_new_tokens=${CAL_NEW:-${NEW:-64}}" ${CAL_SOURCE:+--set "bench.prompts={$CAL_SOURCE}"})
  $PY eval/bench/live.py --config "$CONFIG" --run-dir "$OUT/calibrate" "${SETS[@]}" --set "eval.checkpoint=$(realpath "$CAL_DRAFTER")" \
    "${CAL_SETS[@]}"
  $PY eval/economics/analysis.py --config "$CONFIG" --run-dir "$OUT/calibrate" "${SETS[@]}" "${CAL_SETS[@]}" > /dev/null
fi
[[ $STEPS != cal ]] || exit 0

if [[ -n ${DRAFTER_READY:-} ]]; then
  say "waiting for $DRAFTER_READY"
  end=$((SECONDS + 1200)); until [[ -f $DRAFTER_READY ]]; do (( SECONDS < end )) || { echo "no $DRAFTER_READY"; exit 1; }; sleep 5; done
fi
say "prediction for $DRAFTER from its offline tau alone (no bench of it exists yet)"
$PY eval/offline/accept_len.py --config "$CONFIG" --run-dir "$OUT/test" "${SETS[@]}" --set "eval.checkpoint=$(realpath "$DRAFTER")"
$PY eval/economics/analysis.py --config "$CONFIG" --run-dir "$OUT/test" "${SETS[@]}" --set "eval.checkpoint=$(realpath "$DRAFTER")" \
  --set "bench.calibration=$(realpath "$OUT/calibrate/bench/calibration.json")"
test -f "$OUT/test/bench/prediction.json"

say "the measurement: $DRAFTER on the same prompts and settings"
$PY eval/bench/live.py --config "$CONFIG" --run-dir "$OUT/test" "${SETS[@]}" --set "eval.checkpoint=$(realpath "$DRAFTER")"
$PY eval/economics/analysis.py --config "$CONFIG" --run-dir "$OUT/test" "${SETS[@]}" --set "eval.checkpoint=$(realpath "$DRAFTER")" \
  --set "bench.calibration=$(realpath "$OUT/calibrate/bench/calibration.json")"
