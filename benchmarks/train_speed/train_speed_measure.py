"""train_speed.py's measuring: the model FLOP count, the timer, the matmul rate, memory, the synthetic batch both
sides read, and a side's record."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

# --------------------------------------------------------------------------- FLOPs (GUIDE section 5)


def flop_count(a) -> dict:
    """Model FLOPs per trained token, GUIDE section 5.

    forward = fc once: 2*3Ht*H
            + per TTT step k = 0..K-1:
                qkv   2 * 2H * (heads + 2*kv_heads) * head_dim
                o     2 * heads*head_dim * H
                mlp   2 * 3 * H * ffn                       (gate, up, down)
                lm_head 2 * H * Vd
                attention 4 * heads*head_dim * ctx_k        (QK^T and PV; ctx_k = (T+1)/2 causal keys
                                                             on average + k diagonal keys)
    train = 3 * forward (forward + backward). The frozen embedding lookup is free; a target head that
    a side evaluates (SpecForge offline: 2*Ht*V per token, forward only) is not model FLOPs and is
    listed apart.
    """
    H, Ht, nh, nkv, hd, T, K = a.hidden, a.target_hidden, a.heads, a.kv_heads, a.head_dim, a.seq, a.ttt
    per_step = {
        "qkv": 2 * 2 * H * (nh + 2 * nkv) * hd,
        "o": 2 * nh * hd * H,
        "mlp": 2 * 3 * H * a.ffn,
        "lm_head": 2 * H * a.draft_vocab,
    }
    attn = sum(4 * nh * hd * ((T + 1) / 2 + k) for k in range(K))
    fwd = {
        "fc (once)": 2 * 3 * Ht * H,
        **{f"{n} (x{K})": v * K for n, v in per_step.items()},
        f"attention (sum of {K})": attn,
    }
    fwd_total = sum(fwd.values())
    return {
        "forward_per_token": fwd,
        "forward_total": fwd_total,
        "train_per_token": 3 * fwd_total,
        "per_step_matmuls": per_step,
        "extra_target_head_full_vocab": 2 * Ht * a.vocab,
        "extra_target_head_draft_vocab": 2 * Ht * a.draft_vocab,
    }


# --------------------------------------------------------------------------- timing and memory


class Timer:
    """CUDA events on the GPU (GPU time between the step's first and last enqueue, idle gaps
    included), perf_counter on the CPU. Each step is followed by a synchronize on both."""

    def __init__(self, torch, device):
        self.torch, self.cuda = torch, device.type == "cuda"

    def time(self, fn: Callable[[], object]) -> tuple[float, object]:
        torch = self.torch
        if self.cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            r = fn()
            e1.record()
            torch.cuda.synchronize()
            return e0.elapsed_time(e1), r
        t0 = time.perf_counter()
        r = fn()
        return (time.perf_counter() - t0) * 1e3, r


def matmul_rate(torch, device, dtype, n: int, reps: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in `dtype`, median of `reps` after 3 warm-ups."""
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    y = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    timer = Timer(torch, device)
    for _ in range(3):
        timer.time(lambda: x @ y)
    ms = statistics.median(timer.time(lambda: x @ y)[0] for _ in range(reps))
    return 2 * n**3 / (ms / 1e3)


def mem_alloc(torch, device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


# --------------------------------------------------------------------------- the shared synthetic batch


def make_batch(torch, a, device, dtype) -> dict:
    """Inputs both sides read, and the teacher in each side's form (see the module docstring)."""
    g = torch.Generator(device=device).manual_seed(a.seed)
    B, T, Ht, V, Vd = a.batch, a.seq, a.target_hidden, a.vocab, a.draft_vocab
    draft_ids = torch.randperm(V, device=device, generator=g)[:Vd].sort().values  # S, ascending target ids
    t2d = torch.zeros(V, dtype=torch.bool, device=device)
    t2d[draft_ids] = True
    d2t = draft_ids - torch.arange(Vd, device=device)  # target = draft + d2t[draft]
    u = torch.randn(Ht, device=device, generator=g)
    u /= u.norm()
    # target lm_head W (V, Ht): N(0, 1/Ht) rows, the draft rows tilted towards u
    W = torch.randn(V, Ht, device=device, generator=g) / math.sqrt(Ht)
    W[draft_ids] += (a.draft_boost / math.sqrt(Ht)) * u
    last_hidden = torch.randn(B, T, Ht, device=device, generator=g) + math.sqrt(Ht) * u  # (B, T, Ht)
    W, last_hidden = W.to(dtype), last_hidden.to(dtype)
    topk_ids = torch.empty(B, T, a.topk, dtype=torch.long, device=device)
    topk_lp = torch.empty(B, T, a.topk, dtype=torch.float32, device=device)
    in_draft_argmax, mass = 0, 0.0
    with torch.no_grad():
        for b in range(B):
            for s in range(0, T, 512):  # (512, V) fp32 logits at a time
                lp = torch.log_softmax((last_hidden[b, s : s + 512] @ W.t()).float(), -1)
                v, i = lp.topk(a.topk, dim=-1)
                topk_ids[b, s : s + 512], topk_lp[b, s : s + 512] = i, v
                in_draft_argmax += int(t2d[i[:, 0]].sum())
                mass += float(lp.exp()[:, t2d].sum())
    loss_mask = torch.ones(B, T, dtype=torch.long, device=device)
    loss_mask[:, : int(a.prompt_frac * T)] = 0
    batch = {
        "input_ids": torch.randint(0, V, (B, T), device=device, generator=g),
        "attention_mask": torch.ones(B, T, dtype=torch.long, device=device),
        "loss_mask": loss_mask,
        "aux_hidden": torch.randn(B, T, 3 * Ht, device=device, generator=g).to(dtype),
        "last_hidden": last_hidden,
        "topk_ids": topk_ids,
        "topk_logprobs": topk_lp,
    }
    info = {"argmax_in_draft_vocab": in_draft_argmax / (B * T), "draft_vocab_mass": mass / (B * T)}
    return {"batch": batch, "W": W, "t2d": t2d, "d2t": d2t, "info": info}


# --------------------------------------------------------------------------- sides


@dataclass
class Side:
    name: str
    step: Callable[[], object]  # one full train step; returns the loss (tensor or float)
    notes: str
    resident_bytes: int = 0  # persistent memory after warm-up (params, optimizer state, buffers)
    times_ms: list = field(default_factory=list)
    peak_bytes: int = 0
    losses: list = field(default_factory=list)
    extra_flops_per_token: float = 0.0


def parse_side(spec: str) -> tuple[str, list[str]]:
    kind, _, opts = spec.partition(":")
    return kind.strip(), [o for o in opts.split("+") if o]


def profile_step(torch, device, side: Side, top: int = 25) -> str:
    """One step under torch.profiler: the top ops by self device (or CPU) time, as text."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    side.step()  # warm the allocator
    with profile(activities=acts) as prof:
        side.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60)
