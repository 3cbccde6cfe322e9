"""Repetition loops in an answer, defined once for every figure that counts them apart.

A tiny target at T=0 falls into loops: it copies a stretch of its own answer again and again until the cap, and a
drafter accepts 4-6 tokens per verify there. A user's traffic does not loop like that, so every tau and tok/s is also
given on the loop-free tokens and on the answers that finished before the cap.

The definition is data/loops.py's (training reads it too; its names are this module's as well): a token is
*repeated* when the 8-gram ending at it occurred earlier in the same answer, and a *loop* is a run of >= 8 repeated
tokens.

A decoder emits an answer in spans (a verify's accepted tokens, or a streamed chunk): `split_spans` shares each
span's verifies and seconds out between its loop and loop-free tokens in proportion to their counts, which is exact
for a span that lies wholly on one side.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

from eagle3ft.data.loops import MIN_RUN, NGRAM, loop_mask, repeated  # noqa: F401  (this module's interface too)


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
