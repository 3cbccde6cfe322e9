"""Offline accept length: the count math by hand, and the unroll against real drafting + verification."""

import pytest
import torch
from _eval_tiny import AUX, greedy_items, prompts, tiny_pair

from eagle3ft.drafter.model import DraftCache
from eagle3ft.eval.decode.speculate import SpeculativeDecoder
from eagle3ft.eval.offline.accept_len import ChainCounts, evaluate, walk_interval
from eagle3ft.eval.offline.acceptance import (
    SampleInputs,
    chain_accept_lengths,
    chain_acceptance,
    cycle_walk,
    tree_accept,
)

STEPS = 3


def test_counts_by_hand():
    # 4 roots, depth 3. Root 3 has only depth 1 (the sequence ends), root 2 depths 1-2.
    alpha = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1], [0, 1, 1]], dtype=torch.float64)
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    c = ChainCounts.from_alpha(alpha, valid)
    assert c.attempts == [4, 3, 1] and c.accepts == [3, 2, 0]
    assert c.conditional() == pytest.approx([3 / 4, 2 / 3, 0.0])
    assert c.tau() == pytest.approx(1 + 3 / 4 + 3 / 4 * 2 / 3)
    assert c.tau(1) == pytest.approx(1.75)
    # unconditional per-depth rate is a different number
    assert c.unconditional() == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    # counts are summed before the ratio: two halves add to the whole
    both = ChainCounts.from_alpha(alpha[:2], valid[:2]) + ChainCounts.from_alpha(alpha[2:], valid[2:])
    assert both.tau() == pytest.approx(c.tau())
    # sampled (fractional) acceptance: expected counts
    s = ChainCounts.from_alpha(
        torch.tensor([[0.5, 0.4], [1.0, 0.5]], dtype=torch.float64), torch.ones(2, 2, dtype=torch.bool)
    )
    assert s.attempts == pytest.approx([2.0, 1.5]) and s.accepts == pytest.approx([1.5, 0.7])
    assert s.tau() == pytest.approx(1 + 0.75 + 0.75 * 0.7 / 1.5)


@pytest.fixture(scope="module")
def setup():
    target, drafter = tiny_pair()
    # two sequences the drafter was fitted on (long accepted runs) and two it never saw (mostly rejections)
    return target, drafter, greedy_items(target, prompts(2, seed=1) + prompts(2, seed=7), 30)


def test_offline_chain_equals_brute_force_drafting(setup):
    """For every root of every held-out greedy sequence: one real draft+verify cycle from that prefix
    accepts exactly what the unroll says; so tau from counts equals the brute-force tau."""
    target, drafter, heldout = setup
    dec = SpeculativeDecoder(target, drafter, AUX, steps=STEPS)
    offline, brute, counts = [], [], ChainCounts.zeros(STEPS)
    for item in heldout:
        s = SampleInputs.of(item)
        res = chain_acceptance(drafter, s, STEPS)
        full = res.greedy_valid[:, -1]  # roots with every depth inside the response
        counts = counts + ChainCounts.from_alpha(res.greedy_alpha[full], res.greedy_valid[full])
        ids = s.input_ids.tolist()
        for row in torch.nonzero(full).flatten().tolist():
            r = row + 1
            live = dec.generate(ids[:r], max_new_tokens=2)
            assert live.tokens[0] == ids[r]
            brute.append(live.accept_lengths[0])
            offline.append(1 + int(torch.cumprod(res.greedy_alpha[row], 0).sum()))
    assert len(brute) > 60
    assert offline == brute
    assert counts.tau() == pytest.approx(sum(brute) / len(brute), abs=1e-12)
    assert 1.3 < counts.tau() < STEPS + 1  # the drafter is accepted sometimes, not always


def test_tree_topk1_is_the_chain(setup):
    _, drafter, heldout = setup
    for item in heldout:
        s = SampleInputs.of(item)
        res = chain_acceptance(drafter, s, STEPS)
        acc, is_root, complete = tree_accept(drafter, s, STEPS, topk=1, num_draft_tokens=STEPS + 1)
        chain = 1 + torch.cumprod(res.greedy_alpha, 1).sum(1).long()
        assert torch.equal(acc[complete], chain[complete])
        # every root, a depth outside the data ending the path: the chain's accept lengths, so the same cycle walk
        chain_acc, chain_root = chain_accept_lengths(res, STEPS)
        assert torch.equal(is_root, chain_root) and torch.equal(acc[is_root], chain_acc[is_root])
        assert (~complete & is_root).any()  # the answer's last roots: their deeper depths are past its end


def test_evaluate_report(setup):
    _, drafter, heldout = setup
    rep = evaluate(drafter, heldout, steps=STEPS, topk=2, num_draft_tokens=6)
    assert rep.samples == 4 and rep.roots > 60
    assert [r["depth"] for r in rep.greedy["per_depth"]] == [1, 2, 3]
    assert (
        rep.settings["1/1/2"]["tau"]
        <= rep.settings["2/1/3"]["tau"]
        <= rep.settings["3/1/4"]["tau"]
        == pytest.approx(rep.greedy["tau"])
    )
    assert rep.tree["tau"] >= 1.0 and rep.headline == "tree (greedy)"
    # the sampled figures are checked against a Monte-Carlo draw in test_sampled_acceptance_matches_monte_carlo


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_acceptance_matches_monte_carlo(setup, temperature):
    """Σ_x min(p(x), q(x)) is the probability that a draft x ~ q survives the rejection rule min(1, p(x)/q(x)).
    Estimated independently at depth 1 for every root: q over the target vocab from the drafter's logits placed
    through d2t, p the stored top-k renormalised at the temperature, x drawn from q and accepted with probability
    min(1, p(x)/q(x)); 200k seeded draws per root bound the error by 5 sigma (sigma <= 0.5 / sqrt(n))."""
    _, drafter, heldout = setup
    n = 200_000
    g = torch.Generator().manual_seed(0)
    s = SampleInputs.of(heldout[2])
    T, V, Vd = s.input_ids.shape[0], drafter.config.vocab_size, drafter.config.draft_vocab_size
    with (
        torch.no_grad()
    ):  # entry t (aux of token t, embedding of t+1) drafts token t+2, whose target distribution is row t+1
        _, logits = drafter.step(
            s.input_ids[1:][None], drafter.fuse(s.aux_hidden[:-1][None]), torch.arange(T - 1)[None], DraftCache()
        )
    q = torch.zeros(T - 1, V, dtype=torch.float64)
    q[:, torch.arange(Vd) + drafter.d2t] = torch.softmax(logits[0].double() / temperature, dim=-1)
    p = torch.zeros(T - 1, V, dtype=torch.float64)
    p.scatter_(1, s.topk_ids[1:], torch.softmax(s.topk_logprobs[1:].double() / temperature, dim=-1))
    x = torch.multinomial(q, n, replacement=True, generator=g)  # (T-1, n) drafts
    accept = torch.rand(T - 1, n, generator=g, dtype=torch.float64) < (p.gather(1, x) / q.gather(1, x)).clamp(max=1.0)
    mc = accept.double().mean(1)

    res = chain_acceptance(drafter, s, STEPS, temperature)
    assert (res.sampled_alpha[:, 0] - mc).abs().max() < 5 * 0.5 / n**0.5
    assert 0.05 < float(mc.mean()) < 0.95  # neither trivially rejected nor trivially accepted
    valid = res.sampled_valid[:, 0]
    rep = evaluate(drafter, [heldout[2]], STEPS, temperature=temperature)
    assert rep.sampled["per_depth"][0]["a_k"] == pytest.approx(
        float(mc[valid].mean()), abs=5 * 0.5 / (n * int(valid.sum())) ** 0.5
    )


def _naive_tree_accept(drafter, s, r: int, steps: int, topk: int, num_draft_tokens: int) -> int:
    """SGLang's tree for root r built one node at a time: each node's distribution comes from running
    the drafter down its own path from the prefix (the live chain computation), nothing batched."""
    t = r - 1
    cache = DraftCache()
    h0, lg0 = drafter.step(
        s.input_ids[1 : t + 2][None], drafter.fuse(s.aux_hidden[: t + 1][None]), torch.arange(t + 1)[None], cache
    )
    h0, lg0 = h0[:, -1:], lg0[0, -1]

    def child_logp(path):
        c = DraftCache(cache.k, cache.v)
        h, lg = h0, lg0
        for j, y in enumerate(path):
            h, lgs = drafter.step(torch.tensor([[y]]), h, torch.tensor([[t + 1 + j]]), c)
            lg = lgs[0, -1]
        lp, ids = torch.log_softmax(lg.float(), -1).topk(topk)
        return lp, drafter.draft_to_target(ids)

    lp, ids = child_logp([])
    nodes = [(float(a), (int(b),)) for a, b in zip(lp, ids)]  # (cumulative log prob, path of target ids)
    frontier = list(nodes)
    for _ in range(1, steps):
        cands = []
        for sc, path in frontier:
            lp, ids = child_logp(list(path))
            cands += [(sc + float(a), path + (int(b),)) for a, b in zip(lp, ids)]
        nodes += cands
        frontier = sorted(cands, key=lambda x: -x[0])[:topk]
    kept = {path for _, path in sorted(nodes, key=lambda x: -x[0])[: num_draft_tokens - 1]}
    greedy = tuple(int(s.topk_ids[r + d - 1, 0]) for d in range(1, steps + 1))
    return 1 + max((d for d in range(1, steps + 1) if greedy[:d] in kept), default=0)


def _naive_slot_tree_accept(drafter, s, r: int, steps: int, topk: int, num_draft_tokens: int) -> int:
    """SGLang's draft decode for root r, one slot at a time: slot j's cache holds the prefix and the nodes that held
    slot j at the earlier depths; a node enters slot j with its parent's output hidden state and its own token."""
    t = r - 1
    prefix = DraftCache()
    h0, lg0 = drafter.step(
        s.input_ids[1 : t + 2][None], drafter.fuse(s.aux_hidden[: t + 1][None]), torch.arange(t + 1)[None], prefix
    )
    lp, ids = torch.log_softmax(lg0[0, -1].float(), -1).topk(topk)
    # frontier slot j: (cumulative log prob, path of target ids, draft id, the parent's output hidden)
    front = [(float(a), (int(drafter.draft_to_target(b)),), b, h0[:, -1:]) for a, b in zip(lp, ids)]
    nodes = [(sc, path) for sc, path, _, _ in front]
    slots = [DraftCache(prefix.k, prefix.v) for _ in range(topk)]
    for depth in range(1, steps):
        cands = []
        for j, (sc, path, _, h_in) in enumerate(front):
            h, lgs = drafter.step(torch.tensor([[path[-1]]]), h_in, torch.tensor([[t + depth]]), slots[j])
            lp, ids = torch.log_softmax(lgs[0, -1].float(), -1).topk(topk)
            cands += [(sc + float(a), path + (int(drafter.draft_to_target(b)),), b, h) for a, b in zip(lp, ids)]
        nodes += [(sc, path) for sc, path, _, _ in cands]
        front = sorted(cands, key=lambda x: -x[0])[:topk]
    kept = {path for _, path in sorted(nodes, key=lambda x: -x[0])[: num_draft_tokens - 1]}
    greedy = tuple(int(s.topk_ids[r + d - 1, 0]) for d in range(1, steps + 1))
    return 1 + max((d for d in range(1, steps + 1) if greedy[:d] in kept), default=0)


def test_slot_tree_equals_sglang_slots_one_at_a_time(setup):
    """The default context ("slots") is SGLang's draft decode, node for node. This fitted tiny drafter accepts the
    same with either context, so this alone does not tell them apart: the next test does, on the attention itself."""
    _, drafter, heldout = setup
    n = 0
    with torch.no_grad():
        for item in (heldout[0], heldout[3]):
            s = SampleInputs.of(item)
            acc, _, valid = tree_accept(drafter, s, STEPS, topk=3, num_draft_tokens=8)
            for row in torch.nonzero(valid).flatten().tolist():
                assert int(acc[row]) == _naive_slot_tree_accept(drafter, s, row + 1, STEPS, 3, 8)
                n += 1
    assert n > 40
    with pytest.raises(ValueError, match="tree context 'nope'"):
        tree_accept(drafter, SampleInputs.of(heldout[0]), STEPS, 3, 8, context="nope")


@pytest.mark.parametrize("context", ["slots", "ancestors"])
def test_tree_context_is_what_each_frontier_node_attends_to(setup, monkeypatch, context):
    """Each drafter forward of a frontier: "slots" attends to the entries its slot held at the earlier depths,
    "ancestors" to its parent's; the two differ where a frontier slot's node hangs from another slot's node."""
    from eagle3ft.eval.offline import acceptance

    _, drafter, heldout = setup
    calls = []

    def recording(*args):
        out = step(*args)
        calls.append((args[6].clone(), out[2].clone()))  # (anc (N, depth-1), entries (N,))
        return out

    step = acceptance._node_step
    monkeypatch.setattr(acceptance, "_node_step", recording)
    tree_accept(drafter, SampleInputs.of(heldout[0]), 4, 3, 10, context=context)
    slots_kept = moved = 0
    for (anc, ent), (anc_next, _) in zip(calls, calls[1:]):  # consecutive depths of one chunk of roots
        if anc_next.shape[1] != anc.shape[1] + 1:
            continue  # the next chunk starts
        own = torch.equal(anc_next, torch.cat([anc, ent[:, None]], dim=1))
        slots_kept += own
        moved += not own
    assert (slots_kept > 0 and moved == 0) if context == "slots" else moved > 0


def test_tree_equals_node_by_node_construction(setup):
    _, drafter, heldout = setup
    n = 0
    trees = []
    with torch.no_grad():
        for item in (heldout[0], heldout[3]):
            s = SampleInputs.of(item)
            acc, _, valid = tree_accept(drafter, s, STEPS, topk=3, num_draft_tokens=8, context="ancestors")
            chain = chain_acceptance(drafter, s, STEPS)
            for row in torch.nonzero(valid).flatten().tolist():
                assert int(acc[row]) == _naive_tree_accept(drafter, s, row + 1, STEPS, 3, 8)
                trees.append(int(acc[row]) - (1 + int(torch.cumprod(chain.greedy_alpha[row], 0).sum())))
                n += 1
    assert n > 40
    assert any(d > 0 for d in trees)  # the tree accepted past a rejected top-1 draft somewhere


def test_cycle_walk_by_hand():
    """A cycle at row i emits accept[i] tokens; the next starts at row i + accept[i], or at the next root."""
    assert cycle_walk(torch.tensor([2, 1, 3, 1, 2, 1]), torch.tensor([1, 1, 1, 1, 0, 1]).bool()) == [2, 3, 1]
    # rows 2-3 are the user's turn: the walk restarts at the next answer's first root
    assert cycle_walk(torch.tensor([2, 1, 1, 1, 2, 1]), torch.tensor([1, 1, 0, 0, 1, 1]).bool()) == [2, 2]


def test_walk_interval_is_the_tau_of_the_samples_drawn_again():
    # two answers walked at 4 and 2 tokens per cycle, 100 cycles each: the walk's tau is 3.0
    per_sample = [(400, 100), (200, 100)]
    lo, hi = walk_interval(per_sample, resamples=400)
    assert lo == pytest.approx(2.0) and hi == pytest.approx(4.0)  # a draw of two takes both, one twice or either alone
    assert walk_interval(per_sample, level=0.0, resamples=400) == [pytest.approx(3.0), pytest.approx(3.0)]
    assert walk_interval([(400, 100)]) is None  # one sample: no spread to draw from
    even = [(300, 100)] * 16  # sixteen answers of the same tau: nothing moves
    assert walk_interval(even) == [pytest.approx(3.0), pytest.approx(3.0)]


def test_evaluate_gives_each_walk_its_interval(setup):
    _, drafter, heldout = setup
    rep = evaluate(drafter, heldout, steps=STEPS, topk=2, num_draft_tokens=6)
    for key in ("1/1/2", "3/1/4", f"{STEPS}/2/6"):
        s = rep.settings[key]
        lo, hi = s["tau_walk_interval"]
        assert lo <= s["tau_walk"] <= hi and s["cycles_walk"] > 0
