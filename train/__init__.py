"""The training stage: TTT over the drafter (eagle3ft/drafter/), DeepSpeed through accelerate, checkpoints."""
