"""The live bench: plain against speculative decoding on the same prompts, on the embedded or the SGLang backend."""
