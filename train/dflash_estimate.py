"""Parameter count and per-GPU memory of DFlash drafter training (train/dflash_loss.py), from the config alone.

    python -m eagle3ft.train.estimate --drafter configs/drafters/smollm2-135m-dflash.json --gpus 1 --seq 2048

Model states follow train/estimate.py's ZeRO accounting (bf16 weights and gradients, fp32 master weights and two
moments per trainable parameter); the frozen tensors are the target's embedding and LM head (V x h each, one tensor
when the target ties them). A micro-batch row holds S = seq context tokens and N = anchors x B block tokens (anchors:
up to train.objective.dflash_num_anchors, fewer where an answer is shorter). What autograd keeps per row, counted
tensor by tensor in `saved_bytes`:
- per context token: the features (K·h), fc's output and the context c (hidden_norm, float32 inside), and per draft
  layer the context keys before and after k_norm and RoPE and the values;
- per block token: the embedded block, per layer the norms, q/k/v and their RoPE, the attention output, the MLP's
  four intermediates, and the final norm; the keys and values concatenated with the context's and repeated to every
  query head (S + N rows per layer, the attention's saved inputs);
- per (block token, key) pair: the boolean block mask, once, and per layer its additive form in the activation dtype
  (scaled_dot_product_attention converts a boolean mask before it dispatches and keeps it for the backward);
- the cross-entropy over the target head: dflash_ce_chunk positions of (bf16 logits, float32 copy, log-softmax) at a
  time, recomputed in the backward pass (None: every supervised position at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3ft.drafter.dflash_config import DFlashConfig
from eagle3ft.drafter.dflash_model import DFlashDrafter

GIB = 2**30


@dataclass
class DFlashEstimate:
    trainable_params: int
    frozen_params: int  # the target's embedding and LM head
    largest_param: int
    context_tokens: int  # S per row
    block_tokens: int  # N = anchors x B per row
    saved_bytes_per_row: int
    ce_bytes: int
    gpus: int
    zero2_gib: dict
    zero3_gib: dict


def saved_bytes(cfg: DFlashConfig, context: int, block_tokens: int, act_bytes: int = 2) -> int:
    """Bytes autograd keeps for one row of `context` target positions and `block_tokens` block tokens (module doc)."""
    h, I, L, K = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_features
    q, kv, nh = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.num_attention_heads
    S, N = context, block_tokens
    per_context = act_bytes * (K * h + h + h) + 4 * h + L * act_bytes * (4 * kv)  # features, fc, c; k, k_norm, rope, v
    per_block_layer = act_bytes * (
        2 * h  # input_layernorm in, out
        + 3 * q  # q, q_norm out, RoPE
        + 4 * kv  # block k, k_norm out, RoPE, v
        + 2 * q  # attention output, o_proj input
        + 2 * h  # residual, post_attention_layernorm out
        + 4 * I  # gate, up, silu(gate), product
    ) + 4 * (2 * h + 2 * nh)  # float32 norm statistics and the attention's log-sum-exp
    per_block = act_bytes * h + L * per_block_layer + act_bytes * 2 * h + 4 * h  # noise, layers, final norm
    keys = L * act_bytes * 2 * q * (S + N)  # k and v over [context ‖ block], repeated to every query head
    mask = N * (S + N) * (1 + L * act_bytes)  # the boolean mask once, its additive form per layer
    return S * per_context + N * per_block + keys + mask


def ce_bytes(cfg: DFlashConfig, positions: int, act_bytes: int = 2) -> int:
    """The cross-entropy's transient: positions x V of activation-dtype logits, their float32 copy and log-softmax."""
    return positions * cfg.vocab_size * (act_bytes + 4 + 4)


def estimate(
    cfg: DFlashConfig,
    gpus: int,
    seq: int,
    micro_batch: int,
    num_anchors: int = 512,
    block_size: int | None = None,
    ce_chunk: int | None = 2048,
    tied_head: bool = False,
    zero2_bucket: int = 200_000_000,
) -> DFlashEstimate:
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    trainable = sum(p.numel() for p in model.parameters())
    frozen = (1 if tied_head else 2) * cfg.vocab_size * cfg.hidden_size
    largest = max(max(p.numel() for p in model.parameters()), frozen // (1 if tied_head else 2))
    B = block_size or cfg.block_size
    N = min(num_anchors, seq) * B
    per_row = saved_bytes(cfg, seq, N)
    supervised = micro_batch * min(num_anchors, seq) * (B - 1)
    ce = ce_bytes(cfg, min(ce_chunk, supervised) if ce_chunk else supervised)
    act = (micro_batch * per_row + ce) / GIB
    step_grad = 4 * trainable / gpus / GIB
    z2 = {
        "weights": 2 * (trainable + frozen) / GIB,
        "gradients": 2 * trainable / gpus / GIB + 2 * 2 * zero2_bucket / GIB,
        "optimizer": 12 * trainable / gpus / GIB,
        "activations": act,
        "step_fp32_grad": step_grad,
    }
    z3 = {
        "weights": 2 * (trainable + frozen) / gpus / GIB + 2 * largest / GIB,
        "gradients": 2 * trainable / gpus / GIB,
        "optimizer": 12 * trainable / gpus / GIB,
        "activations": act,
        "step_fp32_grad": step_grad,
    }
    for z in (z2, z3):
        z["total"] = z["weights"] + z["gradients"] + z["optimizer"] + max(z["activations"], z["step_fp32_grad"])
    return DFlashEstimate(trainable, frozen, largest, seq, N, per_row, ce, gpus, z2, z3)


def report(e: DFlashEstimate) -> str:
    lines = [
        f"parameters: {e.trainable_params / 1e9:.3f}B trainable + {e.frozen_params / 1e9:.3f}B frozen target "
        "embedding/LM head",
        f"activations: {e.saved_bytes_per_row / GIB:.2f} GiB per row of {e.context_tokens} context and "
        f"{e.block_tokens} block tokens; cross-entropy transient {e.ce_bytes / GIB:.2f} GiB",
        f"per-GPU memory on {e.gpus} GPUs (GiB):   weights  grads  optim  activ  step  total",
    ]
    for name, z in (("ZeRO-2", e.zero2_gib), ("ZeRO-3", e.zero3_gib)):
        lines.append(
            f"  {name}                        {z['weights']:7.2f} {z['gradients']:6.2f} {z['optimizer']:6.2f} "
            f"{z['activations']:6.2f} {z['step_fp32_grad']:5.2f} {z['total']:6.2f}"
        )
    return "\n".join(lines)
