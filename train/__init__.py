"""The training stage: the EAGLE-3 drafter, TTT, DeepSpeed through accelerate, checkpoints."""
