"""Sampled verification of the embedded DFlash decoder (eval/decode/dflash_decode.py verify_target_only): SGLang's
DFLASH target-only chain rule keeps the target's sampling distribution exactly at its default thresholds, and the
thresholds move it as SGLang's do."""

from __future__ import annotations

import itertools

import torch
from dflash_fixtures import random_dflash, tiny_dflash_config, tiny_target

from eagle3ft.eval.decode.dflash_decode import DFlashDecoder, verify_target_only

V, B, DEPTH = 5, 4, 3  # a toy vocabulary, the block, the tokens whose joint law is compared


def toy_target(seed: int = 0) -> torch.Tensor:
    """A Markov target on V tokens: row t is the next token's distribution after t."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * 1.5, -1)


def toy_drafts(last: int) -> list[int]:
    """A fixed drafter: some drafts likely under the target, some not."""
    return [(last + 1 + i) % V for i in range(B - 1)]


def sample_joint(P: torch.Tensor, n: int, **thresholds) -> torch.Tensor:
    """The empirical law of the first DEPTH tokens after token 0, decoded by block cycles with sampled verify."""
    g = torch.Generator().manual_seed(1)
    counts = torch.zeros((V,) * DEPTH, dtype=torch.float64)
    for _ in range(n):
        out, last = [], 0
        while len(out) < DEPTH:
            drafts = toy_drafts(last)
            chain = [last, *drafts]
            p = P[chain]  # (B, V): row i is the target after chain[..i]
            m, nxt = verify_target_only(p, torch.tensor(drafts), g, **thresholds)
            out += drafts[:m] + [nxt]
            last = out[-1]
        counts[tuple(out[:DEPTH])] += 1
    return counts / n


def exact_joint(P: torch.Tensor) -> torch.Tensor:
    law = torch.zeros((V,) * DEPTH, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=DEPTH):
        prob, last = 1.0, 0
        for t in seq:
            prob, last = prob * float(P[last, t]), t
        law[seq] = prob
    return law


def test_sampled_verify_keeps_the_target_distribution():
    P = toy_target()
    exact = exact_joint(P)
    tv = 0.5 * (sample_joint(P, 12000) - exact).abs().sum()
    assert tv < 0.05, tv
    # a rule that keeps drafts more often than the target would (threshold_acc < 1, as SGLang's flag allows) is
    # visibly off the target's law at the same sample size: the comparison has the power to see a wrong rule
    loose = 0.5 * (sample_joint(P, 12000, threshold_acc=0.4) - exact).abs().sum()
    assert loose > 0.1, loose


def test_rejection_draws_from_the_target_without_the_rejected_token():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    seen = [verify_target_only(p, torch.tensor([0]), g) for _ in range(4000)]
    rejected = [nxt for m, nxt in seen if m == 0]
    assert 0 not in rejected  # d_1 = 0 rejected: never drawn again at that row
    assert abs(len(rejected) / len(seen) - 0.5) < 0.04  # kept with p(d_1) = 0.5
    assert abs(rejected.count(1) / len(rejected) - 0.6) < 0.05  # 0.3 / (0.3 + 0.2)
    # a draft with target probability >= threshold_single is kept whatever the coin
    assert all(verify_target_only(p, torch.tensor([0]), g, threshold_single=0.5)[0] == 1 for _ in range(50))


def test_decoder_samples_reproducibly_from_its_generator():
    model = tiny_target()
    drafter = random_dflash(tiny_dflash_config(), seed=3)

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return DFlashDecoder(model, drafter, temperature=0.8, generator=g).generate([100, 200, 300, 400], 24)

    a, b, c = run(0), run(0), run(1)
    assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths
    assert a.tokens != c.tokens  # the coins come from the generator
    assert sum(a.accept_lengths) >= len(a.tokens) - 1 and a.verify_count == len(a.accept_lengths)
