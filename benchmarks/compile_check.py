#!/usr/bin/env python3
"""Eager against compiled TTT step (train.compile), each against a higher-precision reference (issue 18).

One synthetic batch, one drafter. Four passes over it: eager, eager again (the run-to-run noise floor:
non-deterministic kernels), compiled with `Eagle3Drafter.compile_blocks()` (the path train/loop.py takes
when train.compile is on), and the reference, the same weights and inputs in float64 on the CPU or float32
on CUDA (TF32 off), eager. Each pass is `ttt.ttt_forward` + `torch.autograd.grad` of its loss; per TTT step
the script keeps what the step computes, in order:
  q, k, v   model.qkv: input_layernorm / hidden_norm, q/k/v projections, rope          (compiled blocks)
  attn      the attention core, flash + LSE merge or the "lse" path                     (always eager)
  out       midlayer.finish: o_proj, residual, post_attention_layernorm, SwiGLU MLP    (norm, MLP compiled)
  xn        model.norm over the step's valid rows, the lm_head input                    (compiled)
  ce        the per-row cross-entropy of the step                                       (eager)
then the loss, the per-step losses and the gradient of every trainable parameter. For each tensor it prints
rel = ||a - b|| / ||b|| of eager and compiled against the reference and of compiled against eager. Compiled
is "wrong" where it is further from the reference than eager is by more than a factor (--factor) beyond the
floor of the dtype; the first such tensor in step order says where the two part.

--train-steps N also trains N optimizer steps on the same batch from the same weights for each of eager,
compiled and reference (AdamW 0.9/0.95 on float32 masters, clip 0.5: train/loop.py under DeepSpeed bf16) and
prints the loss trajectories (RESULTS section 1 saw 23.97 compiled against 25.0-25.2 eager after 17 steps).

  python benchmarks/compile_check.py --dims tiny                          # CPU, float32, against float64
  python benchmarks/compile_check.py --dims smollm2 --dtype bf16          # CPU, bf16
  python benchmarks/compile_check.py --dims k2 --train-steps 17 --out $OUT/compile_check_k2.json   # CUDA, bf16
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.train import attention, ttt

REPO = Path(__file__).resolve().parent.parent
PRESETS = {  # drafter config, default sequence length, batch
    "tiny": ("configs/drafters/tiny.json", 64, 2),
    "smollm2": ("configs/drafters/smollm2-135m.json", 256, 1),
    "k2": ("configs/drafters/kimi-k2.json", 2048, 1),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STEP_TENSORS = ("q", "k", "v", "attn", "out", "xn", "ce")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dims", default="tiny", choices=sorted(PRESETS), help="drafter dimensions (configs/drafters/*.json)"
    )
    p.add_argument("--drafter", default=None, help="a drafter config.json instead of the preset's")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default: the preset's)")
    p.add_argument("--batch", type=int, default=None, help="rows (default: the preset's)")
    p.add_argument("--ttt", type=int, default=7, help="TTT steps")
    p.add_argument("--topk", type=int, default=32, help="stored target top-k")
    p.add_argument("--decay", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--factor", type=float, default=2.0, help="compiled is flagged above factor x eager's error (+ floor)"
    )
    p.add_argument(
        "--train-steps", type=int, default=0, help="also train N steps per path and compare the loss trajectories"
    )
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument(
        "--emulate",
        action="store_true",
        help="also compile with inductor's emulate_precision_casts (rounds to the dtype where eager does)",
    )
    p.add_argument("--out", default=None, help="JSON report path")
    a = p.parse_args(argv)
    path, seq, batch = PRESETS[a.dims]
    a.drafter = a.drafter or str(REPO / path)
    a.seq, a.batch = a.seq or seq, a.batch or batch
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "fp32")
    return a


# --------------------------------------------------------------------------- drafter and batch


def build_drafter(cfg: DrafterConfig, device: torch.device, seed: int) -> Eagle3Drafter:
    """The drafter in float32 with its default init, norm weights spread over [0.5, 1.5] and a random draft vocab."""
    torch.manual_seed(seed)
    with torch.device(device):
        m = Eagle3Drafter(cfg)
    m.inv_freq = (
        m.inv_freq.cpu()
    )  # train/loop.py builds on the CPU: inv_freq is a plain attribute the engine leaves there
    g = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for n in (m.norm, m.midlayer.input_layernorm, m.midlayer.hidden_norm, m.midlayer.post_attention_layernorm):
            n.weight.copy_(torch.rand(n.weight.shape, generator=g, device=device) + 0.5)
        draft = torch.randperm(cfg.vocab_size, generator=g, device=device)[: cfg.draft_vocab_size].sort().values
        m.d2t.copy_(draft - torch.arange(cfg.draft_vocab_size, device=device))
        m.t2d.zero_()
        m.t2d[draft] = True
    return m.train()


def make_batch(m: Eagle3Drafter, B: int, T: int, topk: int, device: torch.device, seed: int) -> dict:
    """A collated batch as data/store.py's reader gives it: bf16 aux states, a top-k teacher mostly inside the draft
    vocab."""
    cfg = m.config
    g = torch.Generator(device=device).manual_seed(seed + 2)
    Vd = cfg.draft_vocab_size
    logits = torch.randn(B, T, Vd, generator=g, device=device) * 3  # (B, T, Vd) over the draft vocab
    lp, idx = torch.log_softmax(logits, -1).topk(min(topk, Vd), dim=-1)
    tids = idx + m.d2t[idx]  # draft -> target ids
    outside = torch.rand(B, T, tids.shape[-1], generator=g, device=device) < 0.1  # some mass outside the draft vocab
    tids = torch.where(outside & ~m.t2d[(tids + 1) % cfg.vocab_size], (tids + 1) % cfg.vocab_size, tids)
    loss_mask = torch.ones(B, T, dtype=torch.long, device=device)
    loss_mask[:, : T // 4] = 0
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (B, T), generator=g, device=device),
        "attention_mask": torch.ones(B, T, dtype=torch.long, device=device),
        "loss_mask": loss_mask,
        "aux_hidden": torch.randn(B, T, 3 * cfg.target_hidden_size, generator=g, device=device).bfloat16(),
        "topk_ids": tids,
        "topk_logprobs": lp,
    }


# --------------------------------------------------------------------------- one pass, with per-step captures


class StepCapture:
    """Records, per TTT step, q/k/v, the attention output, the midlayer output, the lm_head input and the CE,
    by wrapping the eager entry points ttt_forward calls (model.qkv, midlayer.finish, the lm_head call)."""

    def __init__(self, model: Eagle3Drafter):
        self.model, self.steps = model, []

    def __enter__(self):
        m, mid = self.model, self.model.midlayer
        qkv, finish = m.qkv, mid.finish

        def qkv_hook(*args, **kw):
            q, k, v = qkv(*args, **kw)
            self.steps.append({"q": q.detach().clone(), "k": k.detach().clone(), "v": v.detach().clone()})
            return q, k, v

        def finish_hook(attn, residual):
            out = finish(attn, residual)
            self.steps[-1].update(attn=attn.detach().clone(), out=out.detach().clone())
            return out

        def head_hook(module, args, output):
            self.steps[-1].update(xn=args[0].detach().clone(), ce=output[0].detach().clone())

        m.qkv, mid.finish = qkv_hook, finish_hook
        self.handle = m.lm_head.register_forward_hook(head_hook)
        return self

    def __exit__(self, *exc):
        del self.model.qkv, self.model.midlayer.finish  # the class methods again
        self.handle.remove()


def run_pass(model: Eagle3Drafter, batch: dict, steps: int, decay: float) -> dict:
    """ttt_forward + grads of every trainable parameter; tensors in step order, then loss, then grads."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with StepCapture(model) as cap:
        out = ttt.ttt_forward(model, batch, steps=steps, decay=decay)
    grads = torch.autograd.grad(out.loss, list(params.values()))
    tensors = {}
    for k, st in enumerate(cap.steps):
        for name in STEP_TENSORS:
            tensors[f"step{k}.{name}"] = st[name]
    tensors["loss"] = out.loss.detach().reshape(1)
    tensors["step_loss"] = out.step_loss.detach()
    for (n, _), g in zip(params.items(), grads):
        tensors[f"grad.{n}"] = g
    return {
        "tensors": tensors,
        "loss": float(out.loss.detach()),
        "correct": out.correct.tolist(),
        "valid": out.valid.tolist(),
    }


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 on b's device (0 when both are 0)."""
    a, b = a.to(b.device, torch.float64), b.double()
    den = float(b.norm())
    num = float((a - b).norm())
    return num / den if den else (0.0 if num == 0 else math.inf)


# --------------------------------------------------------------------------- training trajectories


def train_trajectory(model: Eagle3Drafter, batch: dict, a, fused: bool) -> list[float]:
    """Loss before each of a.train_steps AdamW steps on the same batch (float32 masters when params are 16-bit)."""
    params = [p for p in model.parameters() if p.requires_grad]
    low = params[0].dtype in (torch.bfloat16, torch.float16)
    masters = [p.detach().float().clone() for p in params] if low else params
    opt = torch.optim.AdamW(
        masters, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0, **({"fused": True} if fused else {"foreach": True})
    )
    losses = []
    for _ in range(a.train_steps):
        out = ttt.ttt_forward(model, batch, steps=a.ttt, decay=a.decay)
        grads = torch.autograd.grad(out.loss, params)
        for mp, g in zip(masters, grads):
            mp.grad = g.to(mp.dtype)
        torch.nn.utils.clip_grad_norm_(masters, a.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if low:
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
        losses.append(float(out.loss.detach()))
    return losses


# --------------------------------------------------------------------------- main


def floor_for(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def main(argv=None) -> dict:
    a = parse_args(argv)
    dev = torch.device(a.device)
    dtype = DTYPES[a.dtype]
    ref_dev, ref_dtype = (torch.device("cpu"), torch.float64) if dev.type == "cpu" else (dev, torch.float32)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    cfg = DrafterConfig.from_json(a.drafter)
    print(
        f"# {a.dims}: {a.drafter}; H {cfg.hidden_size}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} x "
        f"{cfg.head_dim}, "
        f"ffn {cfg.intermediate_size}, Vd {cfg.draft_vocab_size}; B {a.batch} x T {a.seq}, TTT {a.ttt}; {a.dtype} on "
        f"{dev}, "
        f"reference {str(ref_dtype)[6:]} on {ref_dev}; torch {torch.__version__}, ATTENTION={attention.ATTENTION}",
        flush=True,
    )
    base = build_drafter(cfg, dev, a.seed)
    batch = make_batch(base, a.batch, a.seq, a.topk, dev, a.seed)
    model = base.to(dtype)  # the weights every path starts from, rounded to the dtype once
    template = copy.deepcopy(model)  # uncompiled, never run

    def fresh(device, dt) -> Eagle3Drafter:
        return copy.deepcopy(template).to(device=device, dtype=dt)

    ref_batch = {k: v.to(ref_dev) for k, v in batch.items()}
    passes, times = {}, {}
    ref_model = fresh(ref_dev, ref_dtype)
    emulate_model = fresh(dev, dtype) if a.emulate else None
    for name, m, b in (("reference", ref_model, ref_batch), ("eager", model, batch), ("eager_rerun", model, batch)):
        t0 = time.perf_counter()
        passes[name] = run_pass(m, b, a.ttt, a.decay)
        times[name] = time.perf_counter() - t0
        print(f"# {name}: loss {passes[name]['loss']:.6f} ({times[name]:.1f} s)", flush=True)
    del ref_model
    model.compile_blocks()  # train.compile, as train/loop.py applies it
    for name in ("compiled", "compiled_again"):
        t0 = time.perf_counter()
        passes[name] = run_pass(model, batch, a.ttt, a.decay)
        times[name] = time.perf_counter() - t0
        print(
            f"# {name}: loss {passes[name]['loss']:.6f} ({times[name]:.1f} "
            f"s{', compiles included' if name == 'compiled' else ''})",
            flush=True,
        )
    if emulate_model is not None:
        import torch._inductor.config as inductor_config

        torch._dynamo.reset()
        emulate_model.compile_blocks()
        with inductor_config.patch(emulate_precision_casts=True):
            passes["compiled_emulate"] = run_pass(emulate_model, batch, a.ttt, a.decay)
        print(f"# compiled_emulate: loss {passes['compiled_emulate']['loss']:.6f}", flush=True)
        del emulate_model
        torch._dynamo.reset()  # its graphs must not serve the plain compiled path below

    ref = passes["reference"]["tensors"]
    cols = [c for c in ("eager", "eager_rerun", "compiled", "compiled_again", "compiled_emulate") if c in passes]
    floor = floor_for(dtype)
    rows, first_bad = [], None
    for key, r in ref.items():
        row = {"tensor": key, "ref_norm": float(r.double().norm())}
        for c in cols:
            row[f"{c}_vs_ref"] = rel_err(passes[c]["tensors"][key], r)
        row["compiled_vs_eager"] = rel_err(passes["compiled"]["tensors"][key], passes["eager"]["tensors"][key])
        row["eager_noise"] = rel_err(passes["eager_rerun"]["tensors"][key], passes["eager"]["tensors"][key])
        if "compiled_emulate" in passes:
            row["emulate_vs_eager"] = rel_err(
                passes["compiled_emulate"]["tensors"][key], passes["eager"]["tensors"][key]
            )
        row["worse"] = row["compiled_vs_ref"] > a.factor * row["eager_vs_ref"] + floor
        rows.append(row)
        if row["worse"] and first_bad is None:
            first_bad = key

    extra = ["emulate_vs_eager"] if "compiled_emulate" in passes else []
    hdr = (
        f"{'tensor':44s} {'|ref|':>10s} "
        + " ".join(f"{c + '>ref':>14s}" for c in cols)
        + f" {'comp>eager':>11s} {'eager noise':>11s}"
        + "".join(f" {'emul>eager':>11s}" for _ in extra)
    )
    print(
        "\n## rel error ||a-b||/||b|| against the reference (and compiled against eager)\n"
        + hdr
        + "\n"
        + "-" * len(hdr)
    )
    for row in rows:
        print(
            f"{row['tensor']:44s} {row['ref_norm']:10.3e} "
            + " ".join(f"{row[c + '_vs_ref']:14.3e}" for c in cols)
            + f" {row['compiled_vs_eager']:11.3e} {row['eager_noise']:11.3e}"
            + "".join(f" {row[e]:11.3e}" for e in extra)
            + ("  <- compiled worse" if row["worse"] else "")
        )
    worst = max(rows, key=lambda r: r["compiled_vs_ref"] / max(r["eager_vs_ref"], 1e-300))
    verdict = (
        "AGREE: compiled is within {f}x of eager's error against the reference on every tensor (floor {fl:.1e})".format(
            f=a.factor, fl=floor
        )
        if first_bad is None
        else f"DIFFER: compiled is further from the reference than eager first at {first_bad}"
    )
    print(
        f"\n{verdict}\nworst ratio compiled/eager error: {worst['tensor']} "
        f"({worst['compiled_vs_ref']:.3e} against {worst['eager_vs_ref']:.3e})"
    )
    if extra:
        import statistics

        gap, emul = (
            statistics.median(r["compiled_vs_eager"] for r in rows),
            statistics.median(r["emulate_vs_eager"] for r in rows),
        )
        why = (
            "the compiled/eager gap is intermediate rounding" if emul < gap / 4 else "rounding does not explain the gap"
        )
        print(
            f"emulate_precision_casts: median rel difference to eager {gap:.3e} compiled, {emul:.3e} compiled with "
            f"eager's roundings ({why})"
        )
    fwd = [r for r in rows if r["tensor"].startswith("step")]
    part = next((r["tensor"] for r in fwd if r["compiled_vs_eager"] > max(10 * r["eager_noise"], floor)), None)
    print(
        "forward: compiled and eager "
        + (f"first part at {part}" if part else "agree at every step within the floor/noise")
    )

    report = {
        "args": {k: v for k, v in vars(a).items()},
        "versions": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        },
        "attention": attention.ATTENTION,
        "reference": f"{ref_dtype} on {ref_dev}",
        "losses": {c: passes[c]["loss"] for c in passes},
        "counts": {c: {"correct": passes[c]["correct"], "valid": passes[c]["valid"]} for c in passes},
        "pass_seconds": times,
        "rows": rows,
        "verdict": verdict,
        "first_worse": first_bad,
        "forward_parts_at": part,
    }

    passes.clear()  # free the captures and gradients before training
    del model
    if a.train_steps:
        print(
            f"\n## {a.train_steps} AdamW steps on this batch from the same weights (lr {a.lr}, clip {a.max_grad_norm})"
        )
        traj = {}
        for name in ("eager", "compiled", "reference"):
            m = fresh(ref_dev, ref_dtype) if name == "reference" else fresh(dev, dtype)
            if name == "compiled":
                torch._dynamo.reset()  # compiled afresh, as a trainer process would
                m.compile_blocks()
            traj[name] = train_trajectory(m, ref_batch if name == "reference" else batch, a, fused=dev.type == "cuda")
            del m
            print(f"# {name}: " + " ".join(f"{x:.4f}" for x in traj[name]), flush=True)
        last = {k: v[-1] for k, v in traj.items()}
        print(
            "last loss: "
            + ", ".join(f"{k} {v:.4f}" for k, v in last.items())
            + f"; eager-ref {last['eager'] - last['reference']:+.4f}, compiled-ref "
            f"{last['compiled'] - last['reference']:+.4f}"
        )
        report["trajectory"] = traj

    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1))
        print(f"# wrote {a.out}")
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["first_worse"] else 0)
