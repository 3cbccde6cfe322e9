#!/usr/bin/env python3
"""Drafter train-step speed: eagle3ft's TTT step against SpecForge 0.2.0's EAGLE-3 training model.

Both sides get the same synthetic batch, the same drafter weights and the same teacher, and run a
real forward + backward + optimizer step each time. Sides run interleaved (A B C A B C ...) with
warm-up, CUDA-event timing, median and min-max; peak memory per side; tokens/s; MFU against the
FLOP count of GUIDE section 5 and a bf16 matmul rate measured at the start. Kimi-K2 dimensions by
default; `--tiny` runs both sides in fp32 on the CPU (SpecForge's Triton loss kernel then runs in
Triton's interpreter, its flex_attention backend cannot run backward on the CPU so it uses "sdpa").

What each side computes per step (batch B x T, TTT steps K, draft vocab Vd, target vocab V):

ours (eagle3ft.train.ttt.ttt_forward, the function train/finetune.py trains with):
  fc once; K steps of the midlayer (causal SDPA over step-0 keys + the row's diagonal keys merged
  through the causal log-sum-exp); per step a fused chunked lm_head + cross-entropy over the valid
  rows only; loss = sum_k 0.8^k * mean CE. Teacher, by variant:
    topk    the stored top-k (--topk) target log-probs, restricted to the draft vocab, renormalised
            (no target head at train time: the store's default form);
    hidden  the stored last hidden state through the target lm_head rows of the draft vocab (Vd x Ht),
            exact draft-vocab softmax (train.target_source=last_hidden).
  Optimizer: train/loop.py's torch AdamW (betas 0.9/0.95, foreach) with the arithmetic DeepSpeed
  ZeRO-2 bf16 gives it on one GPU: bf16 params and grads, fp32 masters + fp32 AdamW state, grad-norm
  clip 0.5 (DeepSpeed itself is not on the H200; its bucketing/copies are not timed). Variants:
  adam=fused (fused AdamW on the masters), adam=bf16 (fused AdamW on the bf16 params, no masters).
theirs (specforge.training.controller.TrainerCore.train_step, the step SpecForge's trainer runs):
  Eagle3TrainStrategy -> OnlineEagle3Model over LlamaForCausalLMEagle3, offline mode
  (target_repr="hidden_state", SpecForge's offline default): the frozen TargetHead (V x Ht) turns
  the stored last hidden state into full-vocab logits every step; softmax restricted to the draft
  vocab; K steps with its attention backend (flex_attention = SpecForge's default, or sdpa = its
  eager TTT attention); its Triton LogSoftmaxLoss over the full (B, T, Vd) logits, acceptance-rate
  and accuracy metrics; loss = sum_k 0.8^k * ploss_k; backward; BF16Optimizer (bf16 params, fp32
  masters + fp32 AdamW, clip 0.5, cosine schedule). Variant compact: its compact teacher (draft-vocab
  rows + streamed full-vocab logsumexp/argmax). Not included: its FSDP wrap (one GPU here; FSDP of
  one rank only re-views the same params) and its data loader.

Both drafters hold the same weights (ours copied into theirs, same key names) and a frozen
embedding excluded from the optimizer. Teacher data: one random target lm_head W (V x Ht) and last
hidden states; the draft vocab S (Vd random target ids) gets a logit boost so that, as with a real
draft vocab, most target argmaxes and ~99% of the mass fall inside it. SpecForge reads W through
its TargetHead; ours reads top-k log-probs computed from the same logits, or W[S].

Usage: see benchmarks/train_speed.sh (H200) and benchmarks/NOTES-train-speed.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

K2 = dict(
    hidden=7168,
    target_hidden=7168,
    heads=64,
    kv_heads=64,
    head_dim=128,
    ffn=18432,
    draft_vocab=32000,
    vocab=163840,
    seq=2048,
    ttt=7,
    batch=1,
    topk=32,
)
TINY = dict(
    hidden=64,
    target_hidden=64,
    heads=4,
    kv_heads=4,
    head_dim=16,
    ffn=128,
    draft_vocab=256,
    vocab=1024,
    seq=64,
    ttt=7,
    batch=1,
    topk=32,
)
DEFAULT_VARIANTS = ["topk", "hidden"]
DEFAULT_THEIRS = {"cuda": "flex_attention", "cpu": "sdpa"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tiny", action="store_true", help="tiny dims, fp32, CPU (unless --device cuda): the CPU check")
    for k, v in K2.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v} (K2) / {TINY[k]} (tiny)")
    p.add_argument(
        "--variant",
        action="append",
        default=None,
        help="one of our variants, options joined by '+': topk|hidden (teacher form), adam=master|fused|bf16, compile "
        "(Eagle3Drafter.compile_blocks: norms, heads + rope, SwiGLU, the TTT attention's merge), baseline "
        "(benchmarks/ttt_baseline.py, the unroll before the speed work), attn=flash|lse, merge=eager (the merge "
        "uncompiled under compile), wgrad=autograd (per-step weight gradients summed by autograd, not "
        "eagle3ft/drafter/wgrad.py's one GEMM per weight), tf32, lse_chunk=N, head_chunk=N; repeat for several "
        f"(default: {' and '.join(DEFAULT_VARIANTS)})",
    )
    p.add_argument(
        "--theirs",
        default=None,
        help="comma list of SpecForge variants, options joined by '+': flex_attention|sdpa, compact; 'none' for "
        f"none (default: {DEFAULT_THEIRS['cuda']} on cuda, {DEFAULT_THEIRS['cpu']} on cpu)",
    )
    p.add_argument(
        "--drafter",
        default=None,
        help="our sides build this drafter config.json (either layout, e.g. configs/drafters/kimi-k2-mla.json); its "
        "dims replace --hidden/--heads/... (FLOPs and MFU still count the Llama layout's attention); needs "
        "--theirs none",
    )
    p.add_argument("--sides", default=None, help="full override: comma list of ours[:opts] / theirs[:opts]")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda unless --tiny)")
    p.add_argument("--dtype", default=None, help="bf16 | fp32 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side before round 1 (compiles happen here)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per side per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of A B C ... interleaving")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--decay", type=float, default=0.8, help="TTT step loss decay (both sides)")
    p.add_argument("--prompt-frac", type=float, default=0.25, help="leading fraction of each row with loss_mask 0")
    p.add_argument(
        "--draft-boost", type=float, default=6.0, help="logit boost of the draft vocab in the synthetic teacher"
    )
    p.add_argument(
        "--matmul-n",
        type=int,
        default=None,
        help="size of the square matmul timed for the peak rate (8192 cuda, 512 cpu)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop starting new rounds after this many seconds (default 480 on cuda: the device's 600-s call limit)",
    )
    p.add_argument(
        "--profile", action="store_true", help="after timing, profile one step per side (top ops by device time)"
    )
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for train_speed[_TAG].json (default $OUT)")
    p.add_argument("--tag", default="", help="suffix of the output files, for several runs into one folder")
    a = p.parse_args(argv)
    base = TINY if a.tiny else K2
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.drafter:
        apply_drafter_dims(a)
    a.device = a.device or ("cpu" if a.tiny else "cuda")
    a.dtype = a.dtype or ("bf16" if a.device == "cuda" else "fp32")
    if a.sides is None:
        theirs = a.theirs or DEFAULT_THEIRS["cuda" if a.device.startswith("cuda") else "cpu"]
        a.sides = ",".join(
            [f"ours:{v}" for v in (a.variant or DEFAULT_VARIANTS)]
            + ([] if theirs == "none" else [f"theirs:{t}" for t in theirs.split(",") if t])
        )
    if a.budget_s is None:
        a.budget_s = 480.0 if a.device.startswith("cuda") else float("inf")
    a.matmul_n = a.matmul_n or (8192 if a.device == "cuda" else 512)
    return a


def apply_drafter_dims(a: argparse.Namespace) -> None:
    """--drafter: the config's dims become the run's (the batch, the teacher and the printed dims follow them)."""
    from eagle3ft.config import resolve_path
    from eagle3ft.drafter.config import DrafterConfig

    if a.theirs != "none" and not (a.sides and "theirs" not in a.sides):
        raise SystemExit("--drafter builds our sides only: add --theirs none")
    c = DrafterConfig.from_json(resolve_path(a.drafter))
    a.hidden, a.target_hidden, a.heads, a.kv_heads = (
        c.hidden_size,
        c.target_hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
    )
    a.head_dim, a.ffn, a.vocab, a.draft_vocab = c.head_dim, c.intermediate_size, c.vocab_size, c.draft_vocab_size


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


# --------------------------------------------------------------------------- helpers


def fmt_flop(x: float, unit: float) -> str:
    return f"{x / unit:,.3f}"


def flop_unit(x: float) -> tuple[float, str]:
    return (1e9, "GFLOP") if x >= 1e9 else (1e6, "MFLOP")


def fmt_rate(r: float) -> str:
    return f"{r / 1e12:.1f} TFLOP/s" if r >= 1e12 else f"{r / 1e9:.1f} GFLOP/s"


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


ADAM_BETAS = (0.9, 0.95)  # train/loop.py's AdamW


class MasterAdamW:
    """bf16 params/grads, fp32 master copies and fp32 AdamW state, grad-norm clip: the arithmetic of
    train/loop.py's torch AdamW under DeepSpeed ZeRO-2 bf16. With fp32 params the masters are the params."""

    def __init__(self, torch, params, lr, max_grad_norm, fused):
        self.torch, self.params, self.max_grad_norm = torch, list(params), max_grad_norm
        self.same = all(p.dtype == torch.float32 for p in self.params)
        self.masters = self.params if self.same else [p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(
            self.masters, lr=lr, betas=ADAM_BETAS, weight_decay=0.0, **({"fused": True} if fused else {"foreach": True})
        )

    def step(self):
        torch = self.torch
        if not self.same:
            for p, m in zip(self.params, self.masters):
                m.grad = p.grad.float()
                p.grad = None
        gn = torch.nn.utils.clip_grad_norm_(self.masters, self.max_grad_norm, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if not self.same:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)
        return gn


class BF16AdamW:
    def __init__(self, torch, params, lr, max_grad_norm, fused):
        self.torch, self.params, self.max_grad_norm = torch, list(params), max_grad_norm
        self.opt = torch.optim.AdamW(
            self.params, lr=lr, betas=ADAM_BETAS, weight_decay=0.0, **({"fused": True} if fused else {"foreach": True})
        )

    def step(self):
        gn = self.torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return gn


def build_ours(torch, a, opts, device, dtype, shared, weights_holder):
    from eagle3ft.config import resolve_path
    from eagle3ft.drafter.config import DrafterConfig
    from eagle3ft.drafter.model_mla import new_drafter

    known = {"topk", "hidden", "compile", "tf32", "baseline"}
    kv = dict(o.split("=", 1) for o in opts if "=" in o)
    flags = {o for o in opts if "=" not in o}
    if flags - known or set(kv) - {"adam", "lse_chunk", "head_chunk", "attn", "merge", "wgrad"}:
        raise SystemExit(f"unknown ours option(s) in {opts}")
    if "baseline" in flags:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "ttt_baseline", os.path.join(os.path.dirname(os.path.abspath(__file__)), "ttt_baseline.py")
        )
        ttt = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ttt)
        modules = [ttt]
    else:
        from eagle3ft.drafter import wgrad
        from eagle3ft.train import attention, losses, ttt

        modules = [ttt, attention, losses, wgrad]
    form = "hidden" if "hidden" in flags else "topk"
    cfg = DrafterConfig(
        hidden_size=a.hidden,
        target_hidden_size=a.target_hidden,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        intermediate_size=a.ffn,
        vocab_size=a.vocab,
        draft_vocab_size=a.draft_vocab,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=max(4096, a.seq + a.ttt),
    )
    if a.drafter:  # its layout (Eagle3DeepseekV2ForCausalLM: MLA) and dims; parse_args set a's dims from it
        cfg = DrafterConfig.from_json(resolve_path(a.drafter), draft_vocab_size=a.draft_vocab)
    with torch.device(device):
        model = new_drafter(cfg)
    # train/loop.py builds the drafter on the CPU and the engine moves parameters and buffers only, so plain
    # tensor attributes (rope's inv_freq) stay on the CPU there: place them the same way here
    for name, val in list(vars(model).items()):
        if isinstance(val, torch.Tensor):
            setattr(model, name, val.cpu())
    model.to(dtype)
    if weights_holder.get("sd") is None:
        # the weights every side starts from, kept on the host so no side's memory counts them
        weights_holder["sd"] = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    else:
        model.load_state_dict(weights_holder["sd"])
    model.d2t.copy_(shared["d2t"])
    model.t2d.copy_(shared["t2d"])
    model.embed_tokens.weight.requires_grad_(False)
    model.train()
    if "compile" in flags:
        model.compile_blocks()  # train.compile: the norms, q/k/v + rope, the MLP; the unroll stays eager
    # experiment knobs: module constants of train/ttt.py and the modules it calls, set around this side's steps only
    knobs = {}
    if "lse_chunk" in kv:
        knobs["LSE_CHUNK"] = int(kv["lse_chunk"])
    if "head_chunk" in kv:
        knobs["HEAD_CHUNK"] = int(kv["head_chunk"])
    if "attn" in kv:
        knobs["ATTENTION"] = kv["attn"]
    if kv.get("merge", "compiled") not in ("compiled", "eager"):
        raise SystemExit(f"merge={kv['merge']}: expected compiled or eager")
    if kv.get("wgrad", "deferred") not in ("deferred", "autograd"):
        raise SystemExit(f"wgrad={kv['wgrad']}: expected deferred or autograd")
    if "merge" in kv:
        knobs["MERGE_COMPILE"] = kv["merge"] == "compiled"
    if "wgrad" in kv:
        knobs["DEFER"] = kv["wgrad"] == "deferred"
    owners = {name: next((m for m in modules if hasattr(m, name)), None) for name in knobs}
    for name, owner in owners.items():
        if owner is None:
            raise SystemExit(f"train/ttt.py and its modules have no {name} any more; drop that variant option")
    heads = next(m for m in modules if hasattr(m, "head_cross_entropy"))  # the module of the fused head CE
    # head_cross_entropy reads HEAD_CHUNK at call time when its `chunk` default is None; if a version binds the
    # constant as the default instead, that default is what must change
    import inspect

    chunk_param = inspect.signature(heads.head_cross_entropy).parameters.get("chunk")
    bind_default = (
        "HEAD_CHUNK" in knobs
        and chunk_param is not None
        and chunk_param.default is not None
        and list(inspect.signature(heads.head_cross_entropy).parameters)[-1] == "chunk"
    )
    params = [p for p in model.parameters() if p.requires_grad]
    adam = kv.get("adam", "master")
    adams = {"master": (MasterAdamW, False), "fused": (MasterAdamW, True), "bf16": (BF16AdamW, device.type == "cuda")}
    if adam not in adams:
        raise SystemExit(f"adam={adam}: expected one of {sorted(adams)}")
    cls, fused = adams[adam]
    opt = cls(torch, params, a.lr, a.max_grad_norm, fused)
    batch = dict(shared["batch"])
    head = shared["W"][shared["t2d"]].clone() if form == "hidden" else None  # (Vd, Ht) draft rows, owned by this side
    tf32 = "tf32" in flags

    def step():
        prev_tf32 = torch.backends.cuda.matmul.allow_tf32
        saved = {n: getattr(owners[n], n) for n in knobs}
        saved_defaults = heads.head_cross_entropy.__defaults__
        torch.backends.cuda.matmul.allow_tf32 = tf32 or prev_tf32
        for n, v in knobs.items():
            setattr(owners[n], n, v)
        if bind_default:
            heads.head_cross_entropy.__defaults__ = saved_defaults[:-1] + (knobs["HEAD_CHUNK"],)
        try:
            out = ttt.ttt_forward(model, batch, steps=a.ttt, decay=a.decay, target_head=head)
            out.loss.backward()
            opt.step()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev_tf32
            for n, v in saved.items():
                setattr(owners[n], n, v)
            heads.head_cross_entropy.__defaults__ = saved_defaults
        return out.loss.detach()

    notes = (
        ("benchmarks/ttt_baseline.py" if "baseline" in flags else "eagle3ft")
        + f" ttt_forward, teacher={form}"
        + (f" (top-{a.topk})" if form == "topk" else " (target head rows of the draft vocab)")
        + {
            "master": ", AdamW(foreach) on fp32 masters",
            "fused": ", fused AdamW on fp32 masters",
            "bf16": ", fused AdamW on the bf16 params",
        }[adam]
        + (", compile_blocks" if "compile" in flags else "")
        + (", tf32" if tf32 else "")
        + "".join(f", {n}={v}" for n, v in knobs.items())
    )
    extra = 2 * a.target_hidden * a.draft_vocab if form == "hidden" else 0
    return step, notes, extra


def build_theirs(torch, a, opts, device, dtype, shared, weights_holder):
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import Eagle3TrainStrategy
    from transformers import LlamaConfig

    backends = {"flex_attention", "sdpa"}
    unknown = set(opts) - backends - {"compact"}
    if unknown:
        raise SystemExit(f"unknown theirs option(s) {sorted(unknown)}")
    backend = next((o for o in opts if o in backends), "flex_attention")
    if backend == "flex_attention" and device.type == "cpu":
        raise SystemExit("SpecForge's flex_attention backend has no CPU backward; use theirs:sdpa on the CPU")
    compact = "compact" in opts
    torch_dtype = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    cfg = LlamaConfig(
        hidden_size=a.hidden,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        intermediate_size=a.ffn,
        vocab_size=a.vocab,
        rms_norm_eps=1e-6,
        max_position_embeddings=max(4096, a.seq + a.ttt),
        hidden_act="silu",
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        torch_dtype=torch_dtype,
    )
    cfg.draft_vocab_size = a.draft_vocab
    cfg.target_hidden_size = a.target_hidden
    with torch.device(device):
        draft = LlamaForCausalLMEagle3(cfg, attention_backend=backend)
    draft.to(dtype)
    missing, unexpected = draft.load_state_dict(weights_holder["sd"], strict=False)
    if unexpected or any("rotary" not in k for k in missing):
        raise SystemExit(f"weight copy into SpecForge's drafter: missing {missing}, unexpected {unexpected}")
    draft.t2d.copy_(shared["t2d"])
    draft.d2t.copy_(shared["d2t"])
    draft.freeze_embedding()
    model = OnlineEagle3Model(draft, length=a.ttt, attention_backend=backend).to(device=device, dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="sf-target-") as tmp, torch.device(device):
        LlamaConfig(hidden_size=a.target_hidden, vocab_size=a.vocab).save_pretrained(
            tmp
        )  # TargetHead reads hidden, vocab
        target_head = TargetHead(tmp)
    target_head.freeze_weights()
    target_head = target_head.eval().to(device=device, dtype=dtype)
    with torch.no_grad():
        target_head.fc.weight.copy_(shared["W"])  # its own copy of the target lm_head, as SpecForge loads it
    backend_obj = FSDPTrainingBackend(
        ParallelConfig(param_dtype=dtype),
        optimizer_factory=lambda m: BF16Optimizer(m, lr=a.lr, max_grad_norm=a.max_grad_norm, total_steps=10_000),
    )
    wrapped = backend_obj.prepare_model(model, wrap=False, optimizer_target=model.draft_model)
    strategy = Eagle3TrainStrategy(wrapped, target_head=target_head, compact_teacher=compact)
    core = TrainerCore(strategy, backend_obj)
    b = shared["batch"]
    batch = TrainBatch(
        sample_ids=[str(i) for i in range(a.batch)],
        strategy="eagle3",
        tensors={
            "input_ids": b["input_ids"],
            "attention_mask": b["attention_mask"],
            "loss_mask": b["loss_mask"],
            "hidden_state": b["aux_hidden"],
            "target": b["last_hidden"],
        },
        metadata={"target_repr": "hidden_state"},
    )
    model.train()

    def step():
        return core.train_step(batch).loss  # forward, loss, backward, BF16Optimizer step, metrics (float)

    notes = (
        f"SpecForge TrainerCore.train_step, attention_backend={backend}, teacher="
        + ("compact (draft rows + streamed full-vocab lse/argmax)" if compact else "full-vocab TargetHead logits")
        + ", BF16Optimizer (fp32 master AdamW)"
    )
    # full-vocab head each step; compact: the draft rows plus the full vocab streamed for lse/argmax
    extra = 2 * a.target_hidden * (a.vocab + (a.draft_vocab if compact else 0))
    return step, notes, extra


# --------------------------------------------------------------------------- main


def versions() -> dict:
    """Library versions, and content hashes of our train code (the device copy has no .git)."""
    import hashlib

    out = {"python": platform.python_version()}
    try:
        from eagle3ft.drafter import model
        from eagle3ft.train import attention, losses, ttt

        for mod in (model, ttt, attention, losses):
            with open(mod.__file__, "rb") as f:
                out[f"sha256[{os.path.basename(mod.__file__)}]"] = hashlib.sha256(f.read()).hexdigest()[:12]
    except Exception:
        pass
    for name in ("torch", "transformers", "triton", "specforge", "eagle3ft"):
        try:
            from importlib.metadata import version

            out[name] = version(name)
        except Exception:
            out[name] = None
    return out


def gpu_info(torch, device) -> dict:
    if device.type != "cuda":
        return {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}
    info = {
        "gpu": torch.cuda.get_device_name(device),
        "total_memory_GiB": torch.cuda.get_device_properties(device).total_memory / 2**30,
    }
    try:
        q = "clocks.sm,clocks.max.sm,clocks.mem,power.draw,driver_version"
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except Exception as e:  # nvidia-smi is optional
        info["nvidia_smi"] = f"unavailable ({e.__class__.__name__})"
    return info


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.device == "cpu":
        # SpecForge's loss is a Triton kernel; on the CPU it runs in Triton's interpreter (set before triton loads)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device; use --tiny for the CPU check")
    torch.manual_seed(a.seed)
    t_start = time.time()

    flops = flop_count(a)
    print(
        f"# dims: hidden {a.hidden} (target {a.target_hidden}), heads {a.heads}/{a.kv_heads} x {a.head_dim}, ffn "
        f"{a.ffn}, "
        f"draft vocab {a.draft_vocab}, vocab {a.vocab}, seq {a.seq}, batch {a.batch}, TTT {a.ttt}, {a.dtype} on "
        f"{device}"
    )
    unit, uname = flop_unit(flops["train_per_token"])
    print(f"# {uname} per token (GUIDE section 5), forward:")
    for k, v in flops["forward_per_token"].items():
        print(f"#   {k:<22} {fmt_flop(v, unit)}")
    print(f"#   {'forward total':<22} {fmt_flop(flops['forward_total'], unit)}")
    print(f"#   {'train (x3)':<22} {fmt_flop(flops['train_per_token'], unit)}")
    print(
        "#   not model FLOPs (forward only): full-vocab target head "
        f"{fmt_flop(flops['extra_target_head_full_vocab'], unit)}, "
        f"its draft-vocab rows {fmt_flop(flops['extra_target_head_draft_vocab'], unit)}"
    )

    rate = matmul_rate(torch, device, dtype, a.matmul_n)
    print(f"# measured matmul rate: {fmt_rate(rate)} ({a.matmul_n}^3 {a.dtype}, median of 10)")
    print(f"# versions: {versions()}")
    print(f"# device: {gpu_info(torch, device)}")

    m0 = mem_alloc(torch, device)
    shared = make_batch(torch, a, device, dtype)
    batch_bytes = mem_alloc(torch, device) - m0
    print(
        f"# synthetic teacher: target argmax in draft vocab {shared['info']['argmax_in_draft_vocab']:.3f}, "
        f"draft-vocab mass {shared['info']['draft_vocab_mass']:.3f}; shared inputs {batch_bytes / 2**30:.2f} GiB"
    )

    timer = Timer(torch, device)
    weights: dict = {}
    sides: list[Side] = []
    failed: dict[str, str] = {}
    specs = [s.strip() for s in a.sides.split(",") if s.strip()]
    # ours first: the first ours model's initial weights are the ones every side starts from
    specs.sort(key=lambda s: parse_side(s)[0] != "ours")
    if not specs or parse_side(specs[0])[0] != "ours":
        raise SystemExit("--sides needs at least one ours side (its weights seed every side)")
    for spec in specs:
        kind, opts = parse_side(spec)
        if kind not in ("ours", "theirs"):
            raise SystemExit(f"side '{spec}': expected ours[:opts] or theirs[:opts]")
        before = mem_alloc(torch, device)
        t0 = time.time()
        build = build_ours if kind == "ours" else build_theirs
        side = None
        try:
            step, notes, extra = build(torch, a, opts, device, dtype, shared, weights)
            side = Side(spec, step, notes, extra_flops_per_token=extra)
            del step
            for _ in range(a.warmup):
                _, loss = timer.time(side.step)
                side.losses.append(float(loss))
        except torch.OutOfMemoryError as e:  # keep the other sides' results
            failed[spec] = f"out of memory while building/warming up: {str(e).splitlines()[0]}"
        except Exception as e:  # a variant that fails on this device must not cost the others' results
            import traceback

            traceback.print_exc()
            failed[spec] = f"{type(e).__name__} while building/warming up: {(str(e).splitlines() or [''])[0]}"
        if spec in failed:
            print(f"# {spec}: {failed[spec]}")
            side = None
            release(torch, device)
            continue
        side.resident_bytes = mem_alloc(torch, device) - before
        print(
            f"# built {spec} in {time.time() - t0:.1f} s (warm-up {a.warmup} steps, losses "
            f"{', '.join(f'{x:.4f}' for x in side.losses)})"
            + (f"; resident {side.resident_bytes / 2**30:.2f} GiB" if device.type == "cuda" else "")
            + f": {side.notes}"
        )
        sides.append(side)
    weights.clear()

    tokens = a.batch * a.seq
    rounds_done = 0
    for r in range(a.rounds):
        if r > 0 and time.time() - t_start > a.budget_s:  # round 1 always runs
            print(f"# time budget {a.budget_s:.0f} s reached: stopping after {rounds_done} round(s)")
            break
        for side in list(sides):
            try:
                timer.time(side.step)  # one untimed step: refills the allocator cache another side may have emptied
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(device)
                base = mem_alloc(torch, device)
                for _ in range(a.steps):
                    ms, loss = timer.time(side.step)
                    side.times_ms.append(ms)
                    side.losses.append(float(loss))
            except torch.OutOfMemoryError as e:
                failed[side.name] = f"out of memory in round {r + 1}: {str(e).splitlines()[0]}"
            if side.name in failed:
                print(f"# {side.name}: {failed[side.name]}; dropped")
                sides.remove(side)
                side.step = None
                release(torch, device)
                continue
            if device.type == "cuda":
                side.peak_bytes = max(
                    side.peak_bytes, torch.cuda.max_memory_allocated(device) - base + side.resident_bytes
                )
        rounds_done += 1
        print(
            f"# round {r + 1}/{a.rounds}: "
            + "; ".join(f"{s.name} {statistics.median(s.times_ms[-a.steps :]):.1f} ms" for s in sides)
        )
        write_json(
            a,
            summarize(a, sides, flops, rate, tokens, device),
            flops,
            rate,
            shared,
            batch_bytes,
            device,
            torch,
            t_start,
            rounds_done,
            failed,
            profiles={},
        )

    profiles = {}
    if a.profile and sides and time.time() - t_start < a.budget_s + 60:
        for side in sides:
            profiles[side.name] = profile_step(torch, device, side)
            print(f"\n## profile of one {side.name} step (top ops by self device time)\n{profiles[side.name]}")
        if a.out:
            with open(os.path.join(a.out, f"profile{'_' + a.tag if a.tag else ''}.txt"), "w") as f:
                f.write("".join(f"## {n}\n{t}\n" for n, t in profiles.items()))

    rows = summarize(a, sides, flops, rate, tokens, device)
    write_json(a, rows, flops, rate, shared, batch_bytes, device, torch, t_start, rounds_done, failed, profiles)
    print_table(a, rows, flops, rate, tokens, rounds_done, failed)
    return 0 if rows else 1


def release(torch, device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def summarize(a, sides: list[Side], flops: dict, rate: float, tokens: int, device) -> list[dict]:
    rows = []
    for s in sides:
        if not s.times_ms:
            continue
        med = statistics.median(s.times_ms)
        tps = tokens / (med / 1e3)
        rows.append(
            {
                "side": s.name,
                "notes": s.notes,
                "step_ms_median": med,
                "step_ms_min": min(s.times_ms),
                "step_ms_max": max(s.times_ms),
                "tokens_per_s": tps,
                "tokens_per_s_min": tokens / (max(s.times_ms) / 1e3),
                "tokens_per_s_max": tokens / (min(s.times_ms) / 1e3),
                "mfu": tps * flops["train_per_token"] / rate,
                "extra_flops_per_token": s.extra_flops_per_token,
                "peak_GiB": s.peak_bytes / 2**30 if device.type == "cuda" else None,
                "resident_GiB": s.resident_bytes / 2**30 if device.type == "cuda" else None,
                "loss_first": s.losses[0],
                "loss_last": s.losses[-1],
                "timed_steps": len(s.times_ms),
                "step_ms_all": s.times_ms,
            }
        )
    base = next((r for r in rows if r["side"].startswith("theirs")), rows[0] if rows else None)
    for r in rows:
        r["base"] = base["side"] if base else None
        r["speedup_vs_base"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["peak_vs_base"] = (r["peak_GiB"] / base["peak_GiB"]) if base and base["peak_GiB"] else None
    return rows


def write_json(
    a, rows, flops, rate, shared, batch_bytes, device, torch, t_start, rounds_done, failed, profiles
) -> None:
    if not a.out:
        return
    result = {
        "args": vars(a),
        "flops": flops,
        "matmul_rate_flops": rate,
        "versions": versions(),
        "device": gpu_info(torch, device),
        "synthetic_teacher": shared["info"],
        "shared_inputs_GiB": batch_bytes / 2**30,
        "rounds_done": rounds_done,
        "results": rows,
        "failed": failed,
        "profiles": profiles,
        "wall_s": time.time() - t_start,
        "timing": "CUDA events around each step, synchronize after each" if device.type == "cuda" else "perf_counter",
        "memory": "peak = resident (params, optimizer state, buffers after warm-up) + max allocated above the start of "
        "the side's timed steps; shared inputs excluded"
        if device.type == "cuda"
        else "not measured on the CPU",
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"train_speed{'_' + a.tag if a.tag else ''}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


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


def print_table(a, rows, flops, rate, tokens, rounds_done, failed) -> None:
    print(
        f"\n## train step, {tokens} tokens/step, {rounds_done} round(s) x {a.steps} timed steps per side, interleaved; "
        f"MFU vs {fmt_rate(rate)} measured and {flops['train_per_token'] / 1e9:.3f} GFLOP/token (GUIDE section 5)"
    )
    hdr = (
        f"{'side':<34} {'step ms median [min-max]':<28} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>9} {'resident':>9} "
        f"{'vs base':>8} {'loss first->last':>18}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        sp = f"{r['speedup_vs_base']:.2f}x" if r["speedup_vs_base"] is not None else "n/a"
        peak = f"{r['peak_GiB']:.1f}" if r["peak_GiB"] is not None else "n/a"
        res = f"{r['resident_GiB']:.1f}" if r["resident_GiB"] is not None else "n/a"
        ms = f"{r['step_ms_median']:.1f} [{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}]"
        print(
            f"{r['side']:<34} {ms:<28} {r['tokens_per_s']:>9.0f} {100 * r['mfu']:>5.1f}% {peak:>9} {res:>9} {sp:>8} "
            f"{r['loss_first']:>8.4f}->{r['loss_last']:.4f}"
        )
    for name, why in failed.items():
        print(f"{name:<34} FAILED: {why}")
    if rows and rows[0]["base"]:
        goal = (
            "; goal: ours >= 1.5x base tokens/s, >= 50% MFU, peak <= base peak"
            if rows[0]["base"].startswith("theirs")
            else ""
        )
        print(f"base = {rows[0]['base']}{goal}")


if __name__ == "__main__":
    sys.exit(main())
