"""Batch-1 attention for the embedded decoders (`bench.embedded.attention: chain`): no mask tensor at all.

A verify feeds K+1 new tokens after a cache. transformers' sdpa path then builds a boolean mask, and per layer
repeats the grouped K/V heads and converts that mask for the kernel: ~900 more aten ops per SmolLM2 forward than a
one-token step (6,595 against 7,510 on transformers 5.24), which is what a verify costs above a plain step where
launches bound the forward. Here every query sees the whole cache and the new tokens causally, the
lower-right causal pattern, which `torch.nn.attention.bias.causal_lower_right` hands to CUDA's flash kernel without
materialising it (the CPU materialises it per layer), and grouped heads go to SDPA as they are (`enable_gqa`). The
GPU path is checked by tests/test_gpu.py. On a GPU a 6-token SmolLM2 verify then costs about a plain step (22.1 ms
against 21.6 ms), where sdpa's cost 20% more (25.8 against 21.5 ms).

Valid only for one sequence without padding, which is what eval/decode/speculate.py's decoders run (prompt prefill, plain
steps, verifies) and eval/offline/same_prompts.py's features (one sequence, no cache). Batched, padded forwards (the harvest)
must keep the default attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

NAME = "eagle3ft_chain"


def chain_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query (1, H, q, D), key/value (1, Hkv, kv, D) with kv >= q -> (1, q, H, D), None. attention_mask is None."""
    if query.shape[0] != 1:
        raise ValueError(f"bench.embedded.attention chain runs one sequence at a time, got a batch of {query.shape[0]}")
    q, kv = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if q == 1:  # a plain step: the one new token sees everything
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=gqa)
    elif q == kv:  # a prefill with no cache
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    else:  # a verify after a cache: query i sees the kv - q cached positions and new positions <= i
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=causal_lower_right(q, kv), scale=scaling, enable_gqa=gqa
        )
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    """transformers builds no mask for this attention (chain_attention knows the pattern)."""
    return None


AttentionInterface.register(NAME, chain_attention)
AttentionMaskInterface.register(NAME, _no_mask)


def use(model: torch.nn.Module, attention: str) -> None:
    """Switch a transformers causal LM to `attention`: "chain" (this module) or "sdpa" (as loaded)."""
    if attention not in ("chain", "sdpa"):
        raise ValueError(f"bench.embedded.attention {attention!r}: expected sdpa or chain")
    if attention == "chain":
        model.set_attn_implementation(NAME)
