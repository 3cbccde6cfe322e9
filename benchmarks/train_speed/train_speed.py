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

Usage: see benchmarks/train_speed/train_speed.sh (H200) and benchmarks/train_speed/NOTES-train-speed.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# its parts stand beside it; PYTHONSAFEPATH (train_speed.sh) leaves the script's folder off sys.path
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_speed_measure import (  # noqa: E402
    Side,
    Timer,
    flop_count,
    make_batch,
    matmul_rate,
    mem_alloc,
    parse_side,
    profile_step,
)
from train_speed_ours import build_ours  # noqa: E402
from train_speed_report import (  # noqa: E402
    flop_unit,
    fmt_flop,
    fmt_rate,
    gpu_info,
    print_table,
    summarize,
    versions,
    write_json,
)
from train_speed_theirs import build_theirs  # noqa: E402

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
        "(benchmarks/train_speed/ttt_baseline.py, the unroll before the speed work), attn=flash|lse, merge=eager "
        "(the merge uncompiled under compile), wgrad=autograd (per-step weight gradients summed by autograd, not "
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


if __name__ == "__main__":
    sys.exit(main())
