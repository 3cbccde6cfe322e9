"""The everyday held-out prompt set (data/sets/everyday-v1.jsonl): its shape, and that no training source holds it.

Contamination: no 8-gram of words (lowercased, split on whitespace, punctuation stripped at each word's ends) of
any user turn of the set (a turn under 8 words: the whole turn, against whole turns) occurs in any turn of ShareGPT or chit-chat (training sources), nor in MT-Bench or HumanEval
(the other held-out sets), each read from the installed package that data/prompts.py reads.
"""

import gzip
import json
import time
from collections import Counter

from eagle3ft.config import REPO_ROOT, SourceConfig
from eagle3ft.data.contamination import N, ngrams, words
from eagle3ft.data.prompts import (
    chitchat_path,
    collect,
    humaneval_path,
    iter_chitchat,
    mtbench_path,
    sharegpt_path,
)
from eagle3ft.data.readers import iter_json_items

SET = "data/sets/everyday-v1.jsonl"
CATEGORIES = {"general", "writing", "code", "math", "advice", "multi-turn"}


def records() -> list[dict]:
    with open(REPO_ROOT / SET, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def everyday_grams() -> dict[tuple[str, ...], str]:
    """Each 8-gram of the set's user turns -> the id of a record holding it."""
    out = {}
    for r in records():
        for m in r["messages"]:
            if m["role"] == "user":
                out.update(dict.fromkeys(ngrams(m["content"]), r["id"]))
    return out


def collisions(grams: dict, texts) -> set[str]:
    """Ids of the set's records with an 8-gram that occurs in one of `texts`."""
    keys, hit = set(grams), set()
    for text in texts:
        if not isinstance(text, str):
            continue
        w = words(text)
        found = keys.intersection(zip(*(w[k:] for k in range(N)))) if len(w) >= N else keys & {tuple(w)}
        hit |= {grams[g] for g in found}
    return hit


def strings(obj):
    """Every string inside a JSON value."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from strings(v)


def test_the_set_loads_through_the_file_source_with_its_categories():
    rows = records()
    skips = Counter()
    convs = collect(
        [SourceConfig(kind="file", path=SET, split="heldout")],
        max_turns=3,
        regenerate=True,
        heldout_fraction=0.0,
        dedupe=True,
        skips=skips,
    )
    assert not skips and len(convs) == len(rows) >= 100
    assert all(c.split == "heldout" and c.source == f"file:{SET}" for c in convs)
    count = Counter(r["category"] for r in rows)
    assert set(count) == CATEGORIES and min(count.values()) >= 15, count
    ids = [r["id"] for r in rows]
    assert len(set(ids)) == len(ids)
    firsts = [r["messages"][0]["content"].strip().lower() for r in rows]
    assert len(set(firsts)) == len(firsts)  # the bench reads the first user turn: no two the same
    for r in rows:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user" if i % 2 == 0 else "assistant" for i in range(len(roles))], r["id"]
        assert roles[-1] == "user" and all(m["content"].strip() for m in r["messages"]), r["id"]
        users = roles.count("user")
        assert (2 <= users <= 3) if r["category"] == "multi-turn" else users == 1, r["id"]
    picked = collect(
        [SourceConfig(kind="file", path=SET, categories=["code"])],
        max_turns=1,
        regenerate=True,
        heldout_fraction=0.0,
        dedupe=True,
        skips=Counter(),
    )
    assert len(picked) == count["code"]


def test_the_set_shares_no_8gram_with_mtbench_humaneval_or_chitchat():
    grams = everyday_grams()
    assert len(grams) > 1000
    with open(mtbench_path(), encoding="utf-8") as f:
        mt = [s for line in f if line.strip() for s in strings(json.loads(line))]
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        he = [s for line in f if line.strip() for s in strings(json.loads(line))]
    assert len(mt) >= 160 and len(he) >= 164 * 4
    assert collisions(grams, mt) == set()
    assert collisions(grams, he) == set()
    chit = [m["content"] for conv in iter_chitchat(chitchat_path(), Counter()) for m in conv.get("messages", [])]
    assert len(chit) > 10_000
    assert collisions(grams, chit) == set()
    # the check finds what it should: a sentence of MT-Bench planted in a set's turn
    planted = {g: "planted" for g in ngrams(max(mt, key=len))}
    assert len(planted) > 1 and collisions(planted, mt) == {"planted"}
    assert collisions({("writing",): "short"}, mt) == {"short"}  # a short turn is matched whole


def sharegpt_texts(skips: Counter):
    with open(sharegpt_path(), "rb") as f:
        for rec in iter_json_items(f, skips):
            for m in rec.get("conversations") or [] if isinstance(rec, dict) else []:
                if isinstance(m, dict):
                    yield m.get("value")


def test_the_set_shares_no_8gram_with_sharegpt():
    grams = everyday_grams()
    skips, seen = Counter(), Counter()
    t0 = time.monotonic()

    def counted():
        for t in sharegpt_texts(skips):
            seen["turns"] += 1
            yield t

    assert collisions(grams, counted()) == set()
    assert seen["turns"] > 100_000, (seen, skips, time.monotonic() - t0)
