"""Repetition loops in an answer, defined once for every figure that counts them apart.

A tiny target at T=0 falls into loops: it copies a stretch of its own answer again and again until the cap, and a
drafter accepts 4-6 tokens per verify there. A user's traffic does not loop like that, so every tau and tok/s is also
given on the loop-free tokens and on the answers that finished before the cap.

The definition: a token is *repeated* when the NGRAM tokens ending at it already occurred, whole, earlier in the
same answer (the earlier occurrence may overlap it). A *loop* is a run of at least MIN_RUN consecutive repeated
tokens, so the answer copies itself verbatim for NGRAM + MIN_RUN - 1 tokens or more. The tokens of such runs are loop
tokens; every other token is loop-free (a phrase said twice in passing is shorter than a run).

A decoder emits an answer in spans (a verify's accepted tokens, or a streamed chunk): `split_spans` shares each
span's verifies and seconds out between its loop and loop-free tokens in proportion to their counts, which is exact
for a span that lies wholly on one side.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

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


@dataclass
class Split:
    """Tokens, verifies and seconds of one part of the answers (verifies and seconds may be fractional: shared)."""

    tokens: float = 0.0
    verifies: float = 0.0
    seconds: float = 0.0
    verified: float = 0.0  # the tokens of spans a verify emitted (not the prefill's first token)

    def __add__(self, o: "Split") -> "Split":
        return Split(*(a + b for a, b in zip(astuple(self), astuple(o))))

    @property
    def tau(self) -> float | None:
        """Tokens per verify, the bonus token included (SGLang's spec_accept_length without the prefill's token)."""
        return self.verified / self.verifies if self.verifies > 0 else None

    @property
    def tok_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


def split_spans(loop: list[bool], spans: list[tuple[int, float, float]]) -> tuple[Split, Split]:
    """(loop-free, loop) totals of an answer emitted in `spans`, each (tokens, verifies, seconds) in order; tokens
    past the mask's end count as loop-free."""
    free, looped, pos = Split(), Split(), 0
    for n, v, s in spans:
        k = sum(loop[pos : pos + n])
        if n > 0:
            by_verify = 1.0 if v > 0 else 0.0
            looped += Split(k, v * k / n, s * k / n, by_verify * k)
            free += Split(n - k, v * (n - k) / n, s * (n - k) / n, by_verify * (n - k))
        pos += n
    return free, looped
