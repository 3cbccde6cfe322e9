# train.sh NAME PORT [sets...]
cd /work/main && . RUN/common.sh
N=$1; P=$2; shift 2
mkdir -p RUN/$N && ln -sfn RUN/run/features RUN/$N/features
cp RUN/run/vocab.safetensors RUN/$N/ 2>/dev/null
.venv/bin/accelerate launch --config_file configs/accelerate/cpu-2proc.yaml --num_processes 1 --main_process_port $P \
  train/finetune.py "${K[@]}" --run-dir RUN/$N --set drafter.init=null --set train.max_steps=200 --set train.save_every=200 \
  --set train.keep_checkpoints=1 --set train.eval_every=50 --set train.log_every=10 "$@" > RUN/$N.log 2>&1
echo "$N exit $?"
