"""Offline τ split by what the drafted tokens are: is a drafter's τ earned on repetition?

A 135M target at T=0 often loops, and a loop is easy to draft. This splits held-out roots two ways and gives the
chain τ (greedy, as eval/offline/accept_len.py counts it) of each part:
  - answer: roots inside an answer cut at `--cut` tokens (at T=0 nearly always a repetition loop) vs the rest;
  - copy: roots whose next token continues an n-gram (`--ngram` tokens ending at the root) seen earlier in the
    same conversation with the same next token (what an n-gram / prompt-lookup drafter gets for free) vs the rest.

    python benchmarks/tau_split.py --config configs/smollm2-135m.yaml --run-dir RUN --drafter DRAFTER [--steps 3] \
        [--set target.path=HF_DIR ...]

RUN holds held-out features (data/harvest.py); prints JSON (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eagle3ft.config import load_config
from eagle3ft.data.store import FeatureStore
from eagle3ft.drafter.export import load_drafter
from eagle3ft.eval.offline.accept_len import ChainCounts
from eagle3ft.eval.offline.acceptance import SampleInputs, chain_acceptance
from eagle3ft.targets.hf import load_input_embedding


def answer_spans(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of every run of loss_mask == 1: one per answer."""
    m = loss_mask.tolist() + [0]
    spans, start = [], None
    for i, v in enumerate(m):
        if v and start is None:
            start = i
        elif not v and start is not None:
            spans.append((start, i))
            start = None
    return spans


def in_cut_answer(loss_mask: torch.Tensor, cut: int) -> torch.Tensor:
    """(T,) bool: the position lies in an answer of at least `cut` tokens."""
    out = torch.zeros(loss_mask.shape[0], dtype=torch.bool)
    for a, b in answer_spans(loss_mask):
        if b - a >= cut:
            out[a:b] = True
    return out


def copyable(ids: list[int], n: int) -> torch.Tensor:
    """(T,) bool: position r's next token r+1 follows the n-gram ids[r-n+1..r] as it did earlier in the sequence."""
    seen: dict[tuple, set] = {}
    out = torch.zeros(len(ids), dtype=torch.bool)
    for r in range(n - 1, len(ids) - 1):
        key = tuple(ids[r - n + 1 : r + 1])
        nxt = ids[r + 1]
        out[r] = nxt in seen.get(key, ())
        seen.setdefault(key, set()).add(nxt)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--drafter", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--cut", type=int, default=1024, help="answers this long were cut by harvest.max_new_tokens")
    ap.add_argument("--ngram", type=int, default=4)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides (the target)")
    args = ap.parse_args()
    cfg = load_config(args.config, args.set)
    drafter = load_drafter(args.drafter, embedding=load_input_embedding(cfg.target)).eval()
    ds = FeatureStore(args.run_dir / "features").dataset("heldout")
    parts = {name: ChainCounts.zeros(args.steps) for name in ("all", "cut", "finished", "copy", "novel")}
    for i in range(len(ds)):
        s = SampleInputs.of(ds[i])
        if s.input_ids.shape[0] < 2:
            continue
        res = chain_acceptance(drafter, s, args.steps)
        roots = slice(1, None)  # row r-1 of the result is root r
        cut = in_cut_answer(s.loss_mask, args.cut)[roots]
        copy = copyable(s.input_ids.tolist(), args.ngram)[roots]
        for name, rows in (
            ("all", torch.ones_like(cut)),
            ("cut", cut),
            ("finished", ~cut),
            ("copy", copy),
            ("novel", ~copy),
        ):
            parts[name] = parts[name] + ChainCounts.from_alpha(res.greedy_alpha[rows], res.greedy_valid[rows])
    out = {
        "drafter": str(args.drafter),
        "features": str(args.run_dir / "features"),
        "samples": len(ds),
        "steps": args.steps,
        "cut": args.cut,
        "ngram": args.ngram,
        "parts": {
            name: {
                "roots": int(c.attempts[0]),  # depth-1 attempts: every counted root
                "tau": {f"{d}/1/{d + 1}": round(c.tau(d), 3) for d in range(1, args.steps + 1)},
            }
            for name, c in parts.items()
        },
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
