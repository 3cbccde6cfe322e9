#!/usr/bin/env bash
# The whole embedded pipeline on SmolLM2-135M on this CPU: harvest -> train -> offline eval -> live bench -> report.
#   bash launch/demo.sh [RUN_DIR]        (make demo; default runs/demo)
# Small sizes come from --set overrides on configs/smollm2-135m.yaml. Rerunning resumes: the harvest
# keeps its finished shards, training resumes from its newest checkpoint (and is skipped once the
# drafter is exported), and the eval and bench stages are skipped when their output is newer than
# the exported drafter.
# One torch thread per process by default: on a shared 2-core machine, two spinning OpenMP threads
# per process made the offline eval 5x slower (OMP_NUM_THREADS=2 make demo on an idle machine).
set -euo pipefail
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$(dirname "$0")/.."
RUN=${1:-runs/demo}
CONFIG=${DEMO_CONFIG:-configs/smollm2-135m.yaml}
SETS=(
  --set 'harvest.sources=[{kind: sharegpt, limit: 16}, {kind: mtbench, limit: 4, split: heldout}]'
  --set harvest.max_turns=1
  --set harvest.max_prompt_tokens=256
  --set harvest.max_total_tokens=384
  --set harvest.max_new_tokens=40
  --set harvest.batch_size=8
  --set harvest.shard_samples=8
  --set train.max_steps=${DEMO_TRAIN_STEPS:-48}
  --set train.ttt_steps=3
  --set train.lr=1e-3
  --set train.warmup_steps=5
  --set train.save_every=24
  --set train.max_len=384
  --set train.wandb_mode=disabled
  --set eval.steps=3
  --set eval.num_draft_tokens=4
  --set 'bench.prompts={kind: mtbench, limit: 2}'
  --set bench.max_new_tokens=32
  --set bench.repetitions=3
  --set 'bench.settings=[{steps: 2, topk: 1, num_draft_tokens: 3}, {steps: 3, topk: 1, num_draft_tokens: 4}]'
)
t_start=$SECONDS
stage() { printf '\n== %s (%ds elapsed)\n' "$1" $((SECONDS - t_start)); }

stage "harvest: target regenerates a ShareGPT slice; MT-Bench prompts held out"
python data/harvest.py --config "$CONFIG" --run-dir "$RUN" "${SETS[@]}"

stage "train: TTT fine-tuning of the drafter (resumes from the newest checkpoint)"
if [[ -f "$RUN/export/model.safetensors" ]]; then
  echo "done: $RUN/export (delete it to train again)"
else
  accelerate launch --config_file configs/accelerate/cpu-2proc.yaml train/finetune.py \
    --config "$CONFIG" --run-dir "$RUN" --resume auto "${SETS[@]}"
fi

stage "offline accept length on the held-out features"
if [[ "$RUN/eval/accept_len.json" -nt "$RUN/export/model.safetensors" ]]; then
  echo "up to date: $RUN/eval/accept_len.json"
else
  python eval/accept_len.py --config "$CONFIG" --run-dir "$RUN" "${SETS[@]}"
fi

stage "live benchmark: plain greedy against speculative decoding, interleaved"
if [[ "$RUN/bench/summary.json" -nt "$RUN/export/model.safetensors" ]]; then
  echo "up to date: $RUN/bench/summary.json"
else
  python eval/bench.py --config "$CONFIG" --run-dir "$RUN" "${SETS[@]}"
fi

stage "report"
python eval/report.py --config "$CONFIG" --run-dir "$RUN" "${SETS[@]}"
printf '\ndemo finished in %ds\n' $((SECONDS - t_start))
