"""Held-out contamination: no training prompt may share an 8-gram of words with a held-out set.

Words are the text lowercased, split on whitespace, each stripped of punctuation at its ends (kept whole if
nothing is left). A text under 8 words is one gram, itself, matched only by an equal text.

    python -m eagle3ft.data.contamination TRAIN.jsonl... [--heldout mtbench humaneval data/sets/everyday-v1.jsonl]

prints, per training file, the records whose user turns share an 8-gram with a held-out set, and exits 1 when
any does.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterable

from eagle3ft.config import SourceConfig
from eagle3ft.data.prompts import Skip, content_key, iter_records, normalize, raw_messages, split_of
from eagle3ft.files import json_text

N = 8
_PUNCT = "\"'`.,:;!?()[]{}<>*_~-–—…“”‘’"
HELDOUT_SETS = ("mtbench", "humaneval", "data/sets/everyday-v1.jsonl")


def words(text: str) -> list[str]:
    return [t.strip(_PUNCT) or t for t in text.lower().split()]


def ngrams(text: str) -> set[tuple[str, ...]]:
    """The text's 8-grams; a text under 8 words is one gram, itself."""
    w = words(text)
    return set(zip(*(w[k:] for k in range(N)))) if len(w) >= N else {tuple(w)}


def user_turns(src: SourceConfig) -> Iterable[str]:
    """Every user turn of a source's records."""
    for record in iter_records(src, Counter()):
        try:
            pairs = raw_messages(record)
        except Skip:
            continue
        yield from (c for r, c in pairs if isinstance(c, str) and str(r).lower() in ("user", "human"))


def source_of(name: str) -> SourceConfig:
    """A held-out set by name (mtbench, humaneval) or a json/jsonl/parquet file."""
    return (
        SourceConfig(kind=name)
        if name in ("mtbench", "humaneval", "sharegpt", "chitchat")
        else SourceConfig(kind="file", path=name)
    )


class HeldoutGrams:
    """The 8-grams of held-out sets' user turns; `hits(text)` names the sets a text shares one with."""

    def __init__(self, sources: Iterable[SourceConfig]):
        self.grams: dict[tuple[str, ...], str] = {}
        for src in sources:
            name = src.kind if src.kind != "file" else str(src.path)
            for text in user_turns(src):
                self.grams.update(dict.fromkeys(ngrams(text), name))

    def hits(self, text: str) -> set[str]:
        return {self.grams[g] for g in ngrams(text) if g in self.grams}


def auto_heldout_turns(src: SourceConfig, max_turns: int, regenerate: bool, fraction: float) -> Iterable[str]:
    """The user turns of the conversations of a `split: auto` source that prompts.collect puts in the held-out split
    (prompts.split_of on their content key)."""
    for record in iter_records(src, Counter()):
        try:
            messages = normalize(record, max_turns, regenerate)
        except Skip:
            continue
        if split_of(content_key(messages, regenerate), fraction) == "heldout":
            yield from (m["content"] for m in messages if m["role"] == "user")


def heldout_filter(
    sources: Iterable[SourceConfig],
    more: Iterable[SourceConfig] = (),
    auto: tuple[int, bool, float] | None = None,
):
    """For prompts.collect: whether a conversation's user turns share an 8-gram with the sources of split heldout
    among `sources`, with `more` (harvest.magpie.heldout), or, given `auto` (harvest.max_turns, regenerate,
    harvest.heldout_fraction), with the conversations that `split: auto` sources draw into the held-out split; None
    when no source sets exclude_heldout."""
    sources = list(sources)
    if not any(s.exclude_heldout for s in sources):
        return None
    grams = HeldoutGrams([s for s in sources if s.split == "heldout"] + list(more))
    if auto is not None and auto[2] > 0:
        for src in sources:
            if src.split == "auto" and src.kind != "tokens":
                name = src.kind if src.kind != "file" else str(src.path)
                for text in auto_heldout_turns(src, *auto):
                    grams.grams.update(dict.fromkeys(ngrams(text), name))
    return lambda messages: any(grams.hits(m["content"]) for m in messages if m["role"] == "user")


def contaminated(grams: HeldoutGrams, sources: Iterable[SourceConfig]) -> dict[str, dict[str, int]]:
    """Per training source, per held-out set: how many of its user turns share an 8-gram with that set."""
    out = {}
    for src in sources:
        hits = Counter(h for t in user_turns(src) for h in grams.hits(t))
        out[src.kind if src.kind != "file" else str(src.path)] = dict(sorted(hits.items()))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Refuse training prompts that share an 8-gram with a held-out set.")
    ap.add_argument("train", nargs="+", help="training sources: sharegpt, chitchat or a json/jsonl/parquet file")
    ap.add_argument("--heldout", nargs="+", default=list(HELDOUT_SETS))
    args = ap.parse_args(argv)
    grams = HeldoutGrams(source_of(h) for h in args.heldout)
    counts = contaminated(grams, [source_of(t) for t in args.train])
    print(json_text({"heldout": args.heldout, "contaminated_user_turns": counts}, "contamination", indent=1))
    if any(counts.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
