"""Live against offline tau prompt by prompt: where a speculative pass's answers part from the plain ones.

A prediction prices the cycle walk on the plain pass's answers; a live speculative pass decodes its own. Where the
two part (bf16 numerics at near-ties), the answers after that token differ in length and in how much they loop, and
a 135M target's loops are what a drafter drafts best. Per prompt of a finished greedy bench run, this prints the
walk on the plain answer, the setting's live tau and the walk on its own answer, both answers' lengths, where they
part, and the share of each answer's 8-grams that repeat an earlier one (a loop's mark). With --leave-out 6,12 the
totals are also given without those prompts. Last, over all prompts: cycles, tokens and the share of the cycles that
emit 1, 2, .. steps+1 tokens, of the two walks and the live pass.

    python benchmarks/tau_per_prompt.py --config configs/smollm2-135m.yaml --run RUN --setting 8/4/32 \
        --set eval.checkpoint=DRAFTER --set "bench.prompts={...}" [--set target.path=HF_DIR ...]

RUN holds bench/runs.jsonl and bench/summary.json (eval/bench/live.py or bench_sglang.py); bench.prompts must be the
source that run used. Prints one JSON line per prompt, then the totals.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eagle3ft.config import load_config, resolve_path
from eagle3ft.data.render import load_prompts, set_labels
from eagle3ft.data.store import check_run_drafter
from eagle3ft.drafter.folder import DrafterFolder
from eagle3ft.eval.offline.acceptance import (
    SampleInputs,
    chain_accept_lengths,
    chain_acceptance,
    cycle_walk,
    tree_accept,
)
from eagle3ft.eval.offline.same_prompts import bench_answers, features
from eagle3ft.run_dir import RunDir
from eagle3ft.setting import Setting
from eagle3ft.targets.hf import load_target


def repeated_share(ids: list[int], n: int = 8) -> float:
    """The share of the answer's n-grams that occurred earlier in it."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    seen, repeats = set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams) if grams else 0.0


@torch.no_grad()
def walk(drafter, item: dict, st: Setting, device, tree_context: str, roots: str = "every") -> list[int]:
    """The tokens each cycle of the cycle walk of one answer emits at setting `st` (eval/offline/accept_len.py's walk).
    roots "complete": a tree's walk over the roots with every depth in the data only (the rule up to 62dbbde)."""
    s = SampleInputs.of(item, device)
    if st.topk > 1:
        acc, is_root, complete = tree_accept(drafter, s, st.steps, st.topk, st.num_draft_tokens, tree_context)
        is_root = complete if roots == "complete" else is_root
    else:
        acc, is_root = chain_accept_lengths(chain_acceptance(drafter, s, st.steps), st.steps)
    return cycle_walk(acc, is_root)


def tau(tokens: int, cycles: int) -> float | None:
    return round(tokens / cycles, 3) if cycles else None  # an answer too short for one complete root


def shares(cycles: list[int], most: int) -> list[float]:
    """The share of the cycles that emit 1, 2, .., most tokens."""
    return [round(cycles.count(n) / len(cycles), 3) for n in range(1, most + 1)] if cycles else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--run", required=True, type=Path, help="a finished greedy bench run folder")
    ap.add_argument("--setting", required=True, help="steps/topk/num_draft_tokens, e.g. 8/4/32")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--leave-out", default="", help="prompt indices, comma-separated: totals without them too")
    ap.add_argument(
        "--roots",
        choices=("every", "complete"),
        default="every",
        help="a tree's walk: over every root (eval/offline/accept_len.py), or only the roots with every depth in the data "
        "(its rule up to 62dbbde, RESULTS §21b)",
    )
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    st = Setting.parse(args.setting)
    model, tok = load_target(cfg.target)
    label, src = set_labels(cfg.bench)[0]
    prompts = load_prompts(cfg.target, tok, src)
    plain, _ = bench_answers(args.run, label, len(prompts))
    own, _ = bench_answers(args.run, label, len(prompts), st.key)
    runs = [json.loads(line) for line in (args.run / "bench" / "runs.jsonl").read_text().splitlines() if line.strip()]
    live = {
        r["prompt_index"]: r
        for r in runs
        if r["mode"] == "speculative" and r["setting"] == st.key and r["repetition"] == 0 and r["prompts"] == label
    }
    folder = DrafterFolder(resolve_path(cfg.eval.checkpoint), "eval.checkpoint")
    drafter, aux_ids = check_run_drafter(folder, RunDir(args.run).features).on_target(model)
    device = next(model.parameters()).device
    left_out = {int(i) for i in args.leave_out.split(",") if i}
    totals = {"plain": [0, 0], "live": [0, 0], "own": [0, 0]}
    kept = {"plain": [0, 0], "live": [0, 0], "own": [0, 0]}
    every = {"plain": [], "live": [], "own": []}  # every cycle's tokens
    for i, (p, a, b) in enumerate(zip(prompts, plain, own)):
        cyc = {
            "plain": walk(drafter, features(model, aux_ids, p, a), st, device, cfg.eval.tree_context, args.roots),
            "live": live[i]["accept_lengths"],  # as the bench's live tau counts
            "own": walk(drafter, features(model, aux_ids, p, b), st, device, cfg.eval.tree_context, args.roots),
        }
        wp, lv, wo = ((sum(c), len(c)) for c in cyc.values())
        for k, c in cyc.items():
            every[k] += c
            for acc in (totals, kept) if i not in left_out else (totals,):
                acc[k][0] += sum(c)
                acc[k][1] += len(c)
        part = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(json.dumps({
            "prompt": i, "plain_tokens": len(a), "own_tokens": len(b), "part_at": part,
            "walk_plain": tau(*wp), "live": tau(*lv), "walk_own": tau(*wo),
            "cycles": {"plain": wp, "live": lv, "own": wo},  # (tokens, cycles) of each
            "repeated_plain": round(repeated_share(a), 2), "repeated_own": round(repeated_share(b), 2),
        }))  # fmt: skip
    print(json.dumps({"setting": st.key, **{f"tau_{k}": t / c for k, (t, c) in totals.items()}}))
    print(json.dumps({"cycles": {k: len(c) for k, c in every.items()}, "tokens": {k: sum(c) for k, c in every.items()},
                      "share_by_tokens_emitted": {k: shares(c, st.steps + 1) for k, c in every.items()}}))  # fmt: skip
    if left_out:
        print(json.dumps({"without": sorted(left_out), **{f"tau_{k}": t / c for k, (t, c) in kept.items()}}))


if __name__ == "__main__":
    main()
