"""What share of a token store's regenerated answer tokens sit in repetition loops, per prompt source?

    python benchmarks/data_loops.py RUN/tokens [RUN2/tokens ...] [--split train] [--out loops.json]

An answer is one run of loss-masked tokens (the tokens the target wrote, end-of-turn included). Each answer's loop
tokens are counted with the live bench's definition (data/loops.py: a run of >= 8 tokens whose 8-gram occurred
earlier in the same answer). Per store and source: answers, answer tokens, loop tokens and their share, the share of
answers with a loop, and for a store of one source the unfinished answers (cut by a cap) its manifest counts. One JSON line per store
and source on stdout, and the whole table in --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from eagle3ft.data.loops import answer_spans, loop_mask
from eagle3ft.data.tokens import TokenStore


def answers(input_ids: list[int], loss_mask: list[int]) -> list[list[int]]:
    """The answers of a sample (data/loops.py answer_spans): one per assistant turn."""
    return [input_ids[a:b] for a, b in answer_spans(loss_mask)]


def store_loops(tokens_dir: str | Path, split: str = "train") -> dict[str, dict]:
    """{source: counts} over one split of one store."""
    store = TokenStore(tokens_dir, verify=False)
    ds = store.dataset(split)
    names = store.sources(split)
    per: dict[str, dict] = defaultdict(lambda: {"answers": 0, "answers_with_loop": 0, "tokens": 0, "loop_tokens": 0})
    for i in tqdm(range(len(ds)), desc=f"loops {Path(tokens_dir).parent.name}", unit="conv", file=sys.stderr):
        row = ds[i]
        c = per[names[i] or "?"]
        for ans in answers(row["input_ids"].tolist(), row["loss_mask"].tolist()):
            n = sum(loop_mask(ans))
            c["answers"] += 1
            c["answers_with_loop"] += n > 0
            c["tokens"] += len(ans)
            c["loop_tokens"] += n
    for c in per.values():
        c["loop_share"] = round(c["loop_tokens"] / max(c["tokens"], 1), 4)
        c["answers_with_loop_share"] = round(c["answers_with_loop"] / max(c["answers"], 1), 4)
    if len(per) == 1:  # the manifest counts unfinished answers per split, not per source
        next(iter(per.values()))["unfinished_answers"] = store.counts(split).get("unfinished_answers", 0)
    return dict(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stores", nargs="+", help="token store folders (RUN/tokens)")
    ap.add_argument("--split", default="train")
    ap.add_argument("--out", help="write the table here as JSON")
    args = ap.parse_args()
    table = {}
    for d in args.stores:
        table[d] = store_loops(d, args.split)
        for name, c in sorted(table[d].items()):
            print(json.dumps({"store": d, "source": name, **c}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
