#!/usr/bin/env bash
# The product's story on SmolLM2-135M on this CPU: the shipped EAGLE-3 drafter (drafters/smollm2-135m),
# measured on a domain it never saw (HumanEval code prompts) and on general prompts (MT-Bench, the everyday set),
# fine-tuned on the domain for a few minutes without losing the rest, measured again; the headline prints
# before -> after, and the verdict which sets gained and which lost.
#   bash launch/demo.sh [RUN_DIR]        (make demo; default runs/demo)
# Stages: harvest (the target regenerates the answers of HumanEval problems: a training part, and a held-out
# part of other problems, plus MT-Bench questions and everyday prompts held out as the general sets, plus ShareGPT
# conversations replayed beside the domain in training, none sharing an 8-gram with a held-out set) -> warm-started
# fine-tune (accelerate, 2 processes; L2-SP toward the shipped weights with a λ the run sets itself, the replay a
# third of the training conversations, and the guard: conversations of the replay and of the domain's training
# part set aside, on which the export is chosen: the best on the domain among the steps that keep the general τ
# within 1% of the start's)
# -> measure, in one process with one target load: both drafters' offline tau per held-out set, then one live
# bench, plain, shipped and fine-tuned interleaved on the HumanEval and MT-Bench prompts -> report -> headline ->
# verdict (eagle3ft compare: per held-out set, tau before -> after with its interval). The recipe is the one
# benchmarks/forgetting.py found best of plain, L2-SP, replay and both, with λ set by the run and the guard; no
# choice reads a held-out set. DEMO_L2SP=0 DEMO_REPLAY_WEIGHT=0 DEMO_GUARD= give the plain fine-tune. Small
# sizes come from --set overrides on configs/smollm2-135m.yaml, whose drafter.init and
# bench.drafters name the shipped drafter. Rerunning resumes: the harvest keeps its finished shards, training
# resumes from its newest checkpoint (and is skipped once the drafter is exported), and each measuring stage
# is skipped when its output is newer than the drafter it measured.
# One torch thread per process by default: on a shared 2-core machine, two spinning OpenMP threads
# per process made the offline eval 5x slower (OMP_NUM_THREADS=2 make demo on an idle machine).
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$(dirname "$0")/.."
RUN=${1:-runs/demo}
CONFIG=${DEMO_CONFIG:-configs/smollm2-135m.yaml}
SHIPPED=${DEMO_SHIPPED:-drafters/smollm2-135m}
# The fine-tune keeps the rest with the recipe benchmarks/forgetting.py found best: L2-SP toward the shipped weights
# (λ set by the run from its first steps: train/l2sp.py) and general conversations replayed as a third of the
# training conversations (12 beside 24); the guard sets 12 other replay conversations and 6 other training problems
# aside (train/guard.py). The rate 1e-4 and an evaluation every 8 steps were chosen on the guard's own validation
# splits, never on a held-out set: at 3e-4 no step kept the general validation τ within 1% of the start's
GUARD=${DEMO_GUARD-replay} # the training source the guard's general validation split is drawn from; empty: no guard
SETS=(
  --set drafter.init="$SHIPPED"
  --set "harvest.sources=[{kind: humaneval, limit: 6, split: heldout}, {kind: humaneval, limit: 30, split: train}, {kind: mtbench, limit: 4, split: heldout}, {kind: file, path: data/sets/everyday-v1.jsonl, limit: 6, split: heldout, name: everyday}, {kind: sharegpt, limit: 24, split: train, name: replay, exclude_heldout: true, weight: ${DEMO_REPLAY_WEIGHT:-1}}]"
  --set harvest.max_turns=1
  --set harvest.max_prompt_tokens=320
  --set harvest.max_total_tokens=448
  --set harvest.max_new_tokens=48
  --set harvest.batch_size=24
  --set harvest.shard_samples=24
  --set train.schedule.max_steps=${DEMO_TRAIN_STEPS:-64}
  --set train.objective.ttt_steps=3
  --set train.optimizer.lr=${DEMO_TRAIN_LR:-1e-4}
  --set train.objective.l2sp=${DEMO_L2SP:-auto}
  --set "train.guard.general_from=${GUARD}"
  --set train.guard.general_samples=12
  --set "train.guard.domain_from=${GUARD:+humaneval}"
  --set train.guard.domain_samples=6
  --set train.schedule.warmup_steps=4
  --set train.checkpoint.save_every=32
  --set train.batch.max_len=448
  --set train.heldout.eval_every=8
  --set train.logging.wandb_mode=disabled
  --set eval.steps=3
  --set eval.num_draft_tokens=4
  --set 'bench.prompts={kind: humaneval, limit: 2}'
  --set 'bench.more_prompts=[{kind: mtbench, limit: 2}]'
  --set bench.drafters="{shipped: $SHIPPED}"
  --set bench.max_new_tokens=40
  --set bench.repetitions=3
  --set 'bench.settings=[{steps: 3, topk: 1, num_draft_tokens: 4}]'
)
t_start=$SECONDS
stage() { printf '\n== %s (%ds elapsed)\n' "$1" $((SECONDS - t_start)); }
newer() { [[ -f "$1" && "$1" -nt "$2" ]]; } # $1 exists and was written after $2

stage "harvest: the target answers HumanEval problems (training part; other problems held out), MT-Bench questions and everyday prompts (held out), and ShareGPT conversations (replayed in training)"
eagle3ft harvest --config "$CONFIG" --run-dir "$RUN" "${SETS[@]}"

stage "fine-tune: TTT from the shipped drafter on the HumanEval training part and the replay, L2-SP toward the shipped weights (resumes from the newest checkpoint)"
python - "$SHIPPED" <<'CARD' || true
import json, sys
card = json.load(open(sys.argv[1] + "/card.json"))
print(f"shipped drafter {sys.argv[1]} ({card.get('status', 'released')}): {card.get('data', '')}")
CARD
if [[ -f "$RUN/export/model.safetensors" ]]; then
  echo "done: $RUN/export (delete it to train again)"
else
  eagle3ft train --accelerate-config configs/accelerate/cpu-2proc.yaml \
    --config "$CONFIG" --run-dir "$RUN" --resume auto "${SETS[@]}"
fi

stage "measure: the shipped and the fine-tuned drafter, offline on the held-out sets, then live against plain decoding, interleaved"
if newer "$RUN/bench/summary.json" "$RUN/export/model.safetensors" && newer "$RUN/bench/summary.json" "$SHIPPED/model.safetensors" \
  && newer "$RUN/demo/offline-export.json" "$RUN/export/model.safetensors"; then
  echo "up to date: $RUN/bench/summary.json, $RUN/demo/offline-*.json"
else
  python eval/report/demo_summary.py measure --config "$CONFIG" --run-dir "$RUN" "${SETS[@]}"
fi

stage "report (the fine-tuned drafter alone: $RUN/eval/report.md)"
eagle3ft report --config "$CONFIG" --run-dir "$RUN" "${SETS[@]}" >/dev/null
echo "wrote $RUN/eval/report.md"

stage "headline ($RUN/demo/summary.md)"
python eval/report/demo_summary.py headline --config "$CONFIG" --run-dir "$RUN" "${SETS[@]}"

stage "verdict: the shipped drafter against the fine-tuned one on every held-out set ($RUN/eval/compare.json)"
eagle3ft compare --config "$CONFIG" --run-dir "$RUN" --before "$SHIPPED" "${SETS[@]}"
printf '\ndemo finished in %ds\n' $((SECONDS - t_start))
