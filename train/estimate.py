"""Parameter count and per-GPU memory of drafter training, from the config alone (meta device).

    python -m eagle3ft.train.estimate --drafter configs/drafters/kimi-k2.json --gpus 8 --seq 2048 --micro-batch 1

A DFlash drafter config (architectures DFlashDraftModel) is estimated by train/dflash_estimate.py instead.

Model states follow the ZeRO paper's accounting for bf16 training with AdamW: bf16 weights (2 B),
bf16 gradients (2 B), fp32 master weights + two moments (12 B) per trainable parameter; the frozen embedding has
weights only. ZeRO-2 partitions gradients and optimizer states over the GPUs and replicates the weights; ZeRO-3
partitions all three and gathers one module at a time (the largest module, the embedding, bounds that transient).
Activations are what autograd keeps per token and per TTT step, counted tensor by tensor in
`activation_bytes_per_token_step`, for the compiled step (the default on CUDA; `--eager` without train.compile).
The TTT unroll's deferred weight gradients (eagle3ft/drafter/wgrad.py) keep every projection's output gradient and the
head's rows until the weight's last use, then concatenate one weight's rows for its GEMM (`deferred_bytes`), on top of
the activations.
The fp32 gradient DeepSpeed builds for the update (4 B per parameter, partitioned) lives only in the optimizer step,
after the backward has freed the activations, so the peak holds the larger of the two, not their sum (the sum was
14-19% above the measured peaks at 1 and 2 GPUs).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import torch

from eagle3ft.config import resolve_path
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.folder import DFLASH_KIND, family_of
from eagle3ft.drafter.model_mla import new_drafter
from eagle3ft.files import json_text, read_json
from eagle3ft.train.losses import HEAD_CHUNK_BYTES

GIB = 2**30


@dataclass
class Estimate:
    trainable_params: int
    frozen_params: int
    largest_param: int  # elements of the largest single weight (gathered whole under ZeRO-3)
    activation_bytes_per_token_step: int
    compiled: bool  # train.compile's activations (the default on CUDA) or eager's
    gpus: int
    tokens_per_gpu: int  # micro batch x sequence length
    ttt_steps: int
    zero2_gib: dict
    zero3_gib: dict


def activation_bytes_per_token_step(cfg: DrafterConfig, act_bytes: int = 2, compiled: bool = False) -> int:
    """Bytes autograd saves per token for one TTT step of train/ttt.py (bf16 activations, fp32 where the code
    upcasts). `compiled` (train.compile, the default on CUDA): the compiled norms recompute their fp32 upcast of the
    input in the backward (three norms per step in the midlayer, two in each layer above it) and the compiled MLP
    recomputes silu(gate), so neither is kept."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attention_mlp = (
        2 * (q + 2 * kv)  # q/k/v before and after RoPE
        + q  # attention output (flash output merged with the diagonal keys)
        + q  # o_proj input
        + 2 * H  # residual sum, post_attention_layernorm input
        + 4 * I  # gate, up, silu(gate), product
    )
    midlayer = (
        2 * H  # input_layernorm and hidden_norm inputs
        + 2 * H  # their concatenation, read by q/k/v
        + attention_mlp
        + 2 * H  # step output, final norm input/output rows for the head
        + cfg.draft_vocab_size  # the fused head CE's softmax - p rows, kept for its backward
    )
    upper = H + attention_mlp + H  # a layer above the midlayer: hidden_norm output (q/k/v input), its output
    fp32 = 4 * (q + 4 * cfg.num_attention_heads)  # per layer: per head log-sum-exp and diagonal scores; index, masks
    up = cfg.num_hidden_layers - 1
    saved = (midlayer + up * upper) * act_bytes + (1 + up) * fp32
    recomputed = (3 * 4 * H + act_bytes * I) + up * (2 * 4 * H + act_bytes * I) if compiled else 0
    return saved - recomputed


def deferred_bytes(cfg: DrafterConfig, tokens: int, ttt_steps: int, act_bytes: int = 2) -> tuple[int, int]:
    """(what eagle3ft/drafter/wgrad.py's stash holds at its most, the largest concatenation), in bytes.

    The stash keeps the output gradients of q/k/v/o, gate/up and down (of every decoder layer) and the head's g·x rows
    (their inputs and the head's softmax - p rows are saved activations already) until each weight's last use, in
    step 0's backward. The head is the first weight that step finishes, so the most is every step's head rows and the
    other weights' rows of steps 1..K-1. Finishing a weight concatenates its input rows and output-gradient rows over
    the steps."""
    H, I, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    head = H  # g·x; softmax - p is saved already
    projections = (q + 2 * kv + H + 2 * I + H) * cfg.num_hidden_layers  # q, k, v, o, gate, up, down per layer
    stash = act_bytes * tokens * (ttt_steps * head + (ttt_steps - 1) * projections)
    widest = max(2 * H + q, q + H, H + I, I + H, H + Vd)  # q (k, v narrower), o, gate/up, down, head
    return stash, act_bytes * ttt_steps * tokens * widest


def estimate(
    cfg: DrafterConfig,
    gpus: int,
    seq: int,
    micro_batch: int,
    ttt_steps: int,
    zero2_bucket: int = 200_000_000,
    compiled: bool = True,
) -> Estimate:
    with torch.device("meta"):
        model = new_drafter(cfg)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    largest = max(p.numel() for p in model.parameters())
    tokens = micro_batch * seq
    per_token = activation_bytes_per_token_step(cfg, compiled=compiled)
    act = per_token * tokens * ttt_steps + sum(deferred_bytes(cfg, tokens, ttt_steps))
    head = (
        min(tokens, HEAD_CHUNK_BYTES // (4 * cfg.draft_vocab_size)) * cfg.draft_vocab_size * (2 + 4 + 4)
    )  # fused head CE: one chunk of bf16 logits, fp32 log-softmax and p·log q
    step_grad = 4 * trainable / gpus / GIB  # the optimizer step's fp32 gradient partition
    z2 = {
        "weights": 2 * (trainable + frozen) / GIB,
        "gradients": 2 * trainable / gpus / GIB + 2 * 2 * zero2_bucket / GIB,  # partitioned + reduce buckets
        "optimizer": 12 * trainable / gpus / GIB,
        "activations": (act + head) / GIB,
        "step_fp32_grad": step_grad,
    }
    z3 = {
        "weights": 2 * (trainable + frozen) / gpus / GIB + 2 * largest / GIB,  # shard + the largest gathered module
        "gradients": 2 * trainable / gpus / GIB,
        "optimizer": 12 * trainable / gpus / GIB,
        "activations": (act + head) / GIB,
        "step_fp32_grad": step_grad,
    }
    for z in (z2, z3):  # backward (activations) and the step (fp32 gradient) peak apart
        z["total"] = z["weights"] + z["gradients"] + z["optimizer"] + max(z["activations"], z["step_fp32_grad"])
    return Estimate(trainable, frozen, largest, per_token, compiled, gpus, tokens, ttt_steps, z2, z3)


def report(e: Estimate) -> str:
    lines = [
        f"parameters: {e.trainable_params / 1e9:.3f}B trainable + {e.frozen_params / 1e9:.3f}B frozen embedding",
        f"activations: {e.activation_bytes_per_token_step / 1024:.0f} KiB per token per TTT step "
        f"({'train.compile' if e.compiled else 'eager'}); "
        f"{e.tokens_per_gpu} tokens x {e.ttt_steps} steps per GPU",
        f"per-GPU memory on {e.gpus} GPUs (GiB):   weights  grads  optim  activ  step  total"
        " (peak: the larger of activ and the step's fp32 grad)",
    ]
    for name, z in (("ZeRO-2", e.zero2_gib), ("ZeRO-3", e.zero3_gib)):
        lines.append(
            f"  {name}                        {z['weights']:7.2f} {z['gradients']:6.2f} {z['optimizer']:6.2f} "
            f"{z['activations']:6.2f} {z['step_fp32_grad']:5.2f} {z['total']:6.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None):
    """The estimate of the drafter config's kind (an EAGLE-3 Estimate, or a DFlash one), printed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="configs/drafters/kimi-k2.json", help="drafter config.json (SGLang form)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--eager", action="store_true", help="train.compile off (the default on CUDA is on)")
    ap.add_argument("--json", action="store_true", help="print the estimate as JSON")
    ap.add_argument("--anchors", type=int, default=512, help="DFlash: blocks per row (dflash_num_anchors)")
    ap.add_argument("--ce-chunk", type=int, default=2048, help="DFlash: cross-entropy positions at a time, 0: all")
    ap.add_argument("--tied-head", action="store_true", help="DFlash: the target ties its LM head to its embedding")
    a = ap.parse_args(argv)
    path = resolve_path(a.drafter)
    if family_of(read_json(path, "the drafter config")) == DFLASH_KIND:  # its own accounting: train/dflash_estimate.py
        from eagle3ft.drafter.dflash_config import DFlashConfig
        from eagle3ft.train import dflash_estimate

        d = dflash_estimate.estimate(
            DFlashConfig.from_json(path), a.gpus, a.seq, a.micro_batch, a.anchors, None, a.ce_chunk or None, a.tied_head
        )
        print(json_text(asdict(d), "estimate", indent=1) if a.json else dflash_estimate.report(d))
        return d
    e = estimate(
        DrafterConfig.from_json(resolve_path(a.drafter)),
        a.gpus,
        a.seq,
        a.micro_batch,
        a.ttt_steps,
        compiled=not a.eager,
    )
    print(json_text(asdict(e), "estimate", indent=1) if a.json else report(e))
    return e


if __name__ == "__main__":
    main()
