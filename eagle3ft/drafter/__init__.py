"""The EAGLE-3 drafter on its own: what data, train and eval share about it, importing none of them.

config.py     DrafterConfig: the drafter's config.json read and written; check_drafter against a target
vocab.py      the draft vocabulary (d2t/t2d): built from loss-masked counts, or copied from a drafter
model.py      the Llama-layout drafter (LlamaForCausalLMEagle3) and its draft KV caches
model_mla.py  the DeepSeek-V2 MLA layout (Eagle3DeepseekV2ForCausalLM); new_drafter picks the layout
wgrad.py      the deferred weight gradient: one GEMM per weight over the TTT steps
export.py     a drafter folder in SGLang's form (also vLLM's eagle3): write, check every key, load
folder.py     DrafterFolder: the one place a drafter folder is opened (config read once, one check, one load)
"""
