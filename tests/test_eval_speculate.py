"""Embedded speculative decoding: exact greedy output, and the sampled rule's distribution."""

import pytest
import torch
from _eval_tiny import AUX, prompts, tiny_pair

from eagle3ft.eval.bench.embedded_backend import TimedSpeculativeDecoder
from eagle3ft.eval.decode.speculate import SpeculativeDecoder, greedy_decode, verify_greedy, verify_sampled


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_greedy_speculation_equals_plain_greedy(pair, steps):
    target, drafter = pair
    dec = SpeculativeDecoder(target, drafter, AUX, steps=steps)
    timed = TimedSpeculativeDecoder(target, drafter, AUX, steps=steps)
    lengths = []
    for p in prompts(3, seed=7) + prompts(2, seed=1):
        spec, plain = dec.generate(p, 32), greedy_decode(target, p, 32)
        assert spec.tokens == plain.tokens
        assert len(spec.tokens) == 32
        assert sum(spec.accept_lengths) >= 31  # every emitted token after the first came from a verify
        again, t = timed.timed_generate(p, 32)  # the bench's timers around the same algorithm
        assert again == spec and t.prefill_s > 0 and t.decode_s > 0
        assert len(t.verify_s) == spec.verify_count == len(t.cycle_s)
        assert len(t.draft_forward_s) == 1 + spec.verify_count * steps
        lengths += spec.accept_lengths
    # the test only means something when drafts are both accepted and rejected
    assert max(lengths) == steps + 1 and (steps == 1 or min(lengths) < steps + 1)


def test_greedy_stops_at_eos(pair):
    target, drafter = pair
    p = prompts(1, seed=7)[0]
    plain = greedy_decode(target, p, 30)
    eos = plain.tokens[12]
    spec = SpeculativeDecoder(target, drafter, AUX, steps=3, eos_ids=[eos]).generate(p, 30)
    cut = plain.tokens[: plain.tokens.index(eos) + 1]
    assert spec.tokens == cut == greedy_decode(target, p, 30, eos_ids=[eos]).tokens


def test_verify_greedy():
    logits = torch.zeros(4, 6)
    logits[torch.arange(4), torch.tensor([2, 5, 1, 0])] = 1.0
    assert verify_greedy(logits, [2, 5, 3]) == (2, 1)
    assert verify_greedy(logits, [2, 5, 1]) == (3, 0)
    assert verify_greedy(logits, [4, 5, 1]) == (0, 2)


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def test_sampled_verification_matches_target_distribution():
    """Draft from q, verify against p: the first emitted token ~ p[0]; the second, given the first
    draft was accepted, ~ p[1]. 20k trials over 5 tokens; TV noise ~0.006, a wrong rule gives > 0.05."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.50, 0.20, 0.15, 0.10, 0.05], [0.05, 0.10, 0.60, 0.05, 0.20], [0.2] * 5], dtype=torch.float64)
    q = torch.tensor([[0.10, 0.50, 0.10, 0.20, 0.10], [0.30, 0.30, 0.10, 0.10, 0.20]], dtype=torch.float64)
    n = 20000
    first = torch.zeros(5, dtype=torch.float64)
    second = torch.zeros(5, dtype=torch.float64)
    accepted_first = 0
    for _ in range(n):
        d = torch.stack([torch.multinomial(q[j], 1, generator=g)[0] for j in range(2)])
        m, nxt = verify_sampled(p, q, d, g)
        out = d[:m].tolist() + [nxt]
        first[out[0]] += 1
        if m >= 1:
            accepted_first += 1
            second[out[1]] += 1
    assert _tv(first, p[0]) < 0.02
    assert _tv(second, p[1]) < 0.03
    # acceptance of the first draft is sum_x min(p, q)
    assert accepted_first / n == pytest.approx(float(torch.minimum(p[0], q[0]).sum()), abs=0.01)
    # a draft distribution equal to p is always accepted
    m, _ = verify_sampled(p, p[:2], torch.tensor([0, 2]), g)
    assert m == 2


def test_sampled_speculation_runs_and_records(pair):
    target, drafter = pair
    g = torch.Generator().manual_seed(3)
    spec = SpeculativeDecoder(target, drafter, AUX, steps=3, temperature=0.8, generator=g).generate(
        prompts(1, seed=7)[0], 30
    )
    assert len(spec.tokens) == 30 and spec.verify_count == len(spec.accept_lengths)
    assert all(1 <= a <= 4 for a in spec.accept_lengths)
