"""Repetition loops in an answer: the one definition, on token ids (eval/ counts them apart, train/ can weight them).

A tiny target at T=0 falls into loops: it copies a stretch of its own answer again and again until the cap.

The definition: a token is *repeated* when the NGRAM tokens ending at it already occurred, whole, earlier in the
same answer (the earlier occurrence may overlap it). A *loop* is a run of at least MIN_RUN consecutive repeated
tokens, so the answer copies itself verbatim for NGRAM + MIN_RUN - 1 tokens or more. The tokens of such runs are loop
tokens; every other token is loop-free (a phrase said twice in passing is shorter than a run).
"""

from __future__ import annotations

NGRAM = 8
MIN_RUN = 8


def repeated(ids: list[int], ngram: int = NGRAM) -> list[bool]:
    """Per token: whether the ngram ending at it occurred earlier in `ids`."""
    seen: set[tuple[int, ...]] = set()
    out = [False] * len(ids)
    for t in range(ngram - 1, len(ids)):
        gram = tuple(ids[t - ngram + 1 : t + 1])
        out[t] = gram in seen
        seen.add(gram)
    return out


def loop_mask(ids: list[int], ngram: int = NGRAM, min_run: int = MIN_RUN) -> list[bool]:
    """Per token: whether it sits in a loop (a run of >= min_run repeated tokens)."""
    rep = repeated(ids, ngram)
    out = [False] * len(ids)
    start = None
    for t, r in enumerate(rep + [False]):
        if r and start is None:
            start = t
        elif not r and start is not None:
            if t - start >= min_run:
                out[start:t] = [True] * (t - start)
            start = None
    return out


def answer_spans(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each maximal run of mask-set positions of a sample: one assistant turn each."""
    out, t = [], 0
    while t < len(mask):
        if not mask[t]:
            t += 1
            continue
        end = t
        while end < len(mask) and mask[end]:
            end += 1
        out.append((t, end))
        t = end
    return out


def answer_loops(ids: list[int], mask: list[int]) -> list[bool]:
    """Per position of a sample: whether the token sits in a loop of its own answer, each answer (answer_spans) taken
    apart; False outside the answers."""
    out = [False] * len(ids)
    for a, b in answer_spans(mask):
        out[a:b] = loop_mask(ids[a:b])
    return out
