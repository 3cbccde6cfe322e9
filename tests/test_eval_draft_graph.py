"""bench.embedded.drafting graph (eval/decode/draft_graph.py): the draft chain on the device over a static cache drafts what the
eager chain drafts, cycle by cycle, through the decoder and the real bench; its cache grows for longer requests;
bad settings are refused. The CUDA capture itself: tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch
from _eval_tiny import AUX, prompts, tiny_config_bench, tiny_pair

from eagle3ft.drafter.model import DraftCache
from eagle3ft.eval.bench.embedded_backend import drafting_for
from eagle3ft.eval.decode.draft_graph import DraftGraph, chain_drafts
from eagle3ft.eval.decode.speculate import SpeculativeDecoder, greedy_decode


class Recording(SpeculativeDecoder):
    """Records every cycle's drafts."""

    def draft(self, s):
        drafts, qs = super().draft(s)
        self.seen.append(list(drafts))
        return drafts, qs


def _run(target, drafter, p, steps, drafting, new=40, graph_extend=False):
    dec = Recording(target, drafter, AUX, steps=steps, drafting=drafting, graph_extend=graph_extend)
    dec.seen = []
    return dec.generate(p, new), dec.seen


@pytest.mark.parametrize("graph_extend", [False, True])
@pytest.mark.parametrize("steps", [1, 3, 6])
def test_the_static_chain_drafts_what_the_eager_chain_drafts(steps, graph_extend):
    target, drafter = tiny_pair()
    for p in prompts(3):
        eager, eager_drafts = _run(target, drafter, p, steps, "eager")
        graph, graph_drafts = _run(target, drafter, p, steps, "graph", graph_extend=graph_extend)
        assert graph_drafts == eager_drafts  # every cycle's drafts
        assert graph.accept_lengths == eager.accept_lengths
        assert graph.tokens == eager.tokens == greedy_decode(target, p, 40).tokens
    assert max(a for a in eager.accept_lengths) > 1  # drafts were accepted: the chain's later steps mattered


def test_chain_drafts_writes_its_rows_and_reads_only_the_rows_so_far():
    """One chain against eager steps on a DraftCache, after garbage in the static rows beyond the cache's length."""
    _, drafter = tiny_pair()
    cfg, H = drafter.config, drafter.config.hidden_size
    g = torch.Generator().manual_seed(3)
    ids, hid = torch.randint(0, cfg.vocab_size, (1, 9), generator=g), torch.randn(1, 9, H, generator=g).double()
    static = DraftCache.static(cfg, 32, torch.device("cpu"), torch.float64)
    static.k.normal_(generator=g)
    static.v.normal_(generator=g)  # stale rows: the mask must hide them
    eager = DraftCache()
    with torch.no_grad():
        h, lg = drafter.step(ids, hid, torch.arange(9)[None], eager)
        h_s, lg_s = drafter.step(ids, hid, torch.arange(9)[None], static)
        torch.testing.assert_close(lg_s, lg, rtol=0, atol=0)
        got = chain_drafts(drafter, static, lg_s[0, -1], h_s[:, -1:], torch.tensor([9]), torch.arange(32), 4)
        want, h, lg = [], h[:, -1:], lg[0, -1]
        for j in range(4):
            want.append(int(drafter.draft_to_target(lg.argmax(-1))))
            if j < 3:
                h, lgs = drafter.step(torch.tensor([[want[-1]]]), h, torch.tensor([[9 + j]]), eager)
                lg = lgs[0, -1]
    assert got.tolist() == want
    torch.testing.assert_close(static.k[:, :, :12], eager.k, rtol=1e-12, atol=1e-12)
    assert static.length == 9  # the chain's rows are not the cache's until an extend appends them


def test_the_static_extend_gives_the_eager_extends_outputs_and_rows():
    """DraftGraph.extend (uncaptured on the CPU) over 1..steps+1 accepted tokens after a prompt, against
    Eagle3Drafter.step on a DraftCache: the same last feedback and logits, the same cache rows, and the chain's inputs
    written in place; an extend that is not at the cache's end is refused."""
    _, drafter = tiny_pair()
    cfg = drafter.config
    g = torch.Generator().manual_seed(5)
    graph = DraftGraph(drafter, steps=4, capacity=64, device=torch.device("cpu"), extend=True)
    eager = DraftCache()
    ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=g)
    aux = torch.randn(8, 3 * cfg.target_hidden_size, generator=g).double()
    with torch.no_grad():
        drafter.step(ids, drafter.fuse(aux[None]), torch.arange(8)[None], eager)
        drafter.step(ids, drafter.fuse(aux[None]), torch.arange(8)[None], graph.cache)
        start = 8
        for t in (1, 3, 5):
            new = torch.randint(0, cfg.vocab_size, (t,), generator=g).tolist()
            a = torch.randn(t, 3 * cfg.target_hidden_size, generator=g).double()
            pos = torch.arange(start, start + t)[None]
            h_e, lg_e = drafter.step(torch.tensor([new]), drafter.fuse(a[None]), pos, eager)
            h_s, lg_s = graph.extend(new, a, start)
            torch.testing.assert_close(lg_s, lg_e[0, -1], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(h_s, h_e[:, -1:], rtol=1e-12, atol=1e-12)
            assert h_s is graph.h and lg_s is graph.logits  # the chain reads them where they are
            start += t
        assert graph.cache.length == eager.length == start
        torch.testing.assert_close(graph.cache.k[:, :, :start], eager.k, rtol=1e-12, atol=1e-12)
        with pytest.raises(ValueError, match="an extend at row 3"):
            graph.extend([1], a[:1], 3)
        with pytest.raises(ValueError, match="not 6"):
            graph.extend([1] * 6, a[:1].expand(6, -1), start)
    with pytest.raises(ValueError, match="built without extend"):
        DraftGraph(drafter, steps=4, capacity=64, device=torch.device("cpu")).extend([1], a[:1], 0)


def test_the_graph_grows_for_a_longer_request_and_refuses_sampling():
    target, drafter = tiny_pair()
    dec = SpeculativeDecoder(target, drafter, AUX, steps=3, drafting="graph")
    p = prompts(1)[0]
    dec.generate(p, 8)
    assert dec.graph.capacity == 1024
    first = dec.graph
    dec.generate(p, 8)
    assert dec.graph is first  # reused
    dec.generate(p, 1100)  # more rows than 1024: a new graph, the next power of two
    assert dec.graph.capacity == 2048
    with pytest.raises(ValueError, match="greedy"):
        SpeculativeDecoder(target, drafter, AUX, steps=3, temperature=0.7, drafting="graph")
    with pytest.raises(ValueError, match="expected eager or graph"):
        SpeculativeDecoder(target, drafter, AUX, steps=3, drafting="cuda")
    assert drafting_for("auto", 0.0) == "graph" and drafting_for("auto", 0.7) == "eager"
    with pytest.raises(ValueError, match="bench.temperature is 0.7"):
        drafting_for("graph", 0.7)
    with pytest.raises(ValueError, match="expected auto, graph or eager"):
        drafting_for("fast", 0.0)


def test_the_embedded_bench_drafts_the_same_with_the_graphed_chain(tmp_path):
    """bench.embedded.drafting graph and eager through eval/bench/live.py's embedded backend on the tiny config: the same output
    ids and accept lengths per prompt and pass, the environment names the drafting, every forward is timed."""
    outputs = {}
    for label, drafting, extend in (("eager", "eager", False), ("graph", "graph", False), ("extend", "graph", True)):
        sets = ["bench.prompts.limit=2", "bench.max_new_tokens=6", "bench.repetitions=2", f"bench.embedded.drafting={drafting}",
                f"bench.embedded.draft_graph_extend={extend}", "bench.settings=[{steps: 3, topk: 1, num_draft_tokens: 4}]"]  # fmt: skip
        summary, rows = tiny_config_bench(tmp_path, label, sets)
        assert summary["environment"]["drafting"] == drafting
        assert summary["environment"]["draft_graph_extend"] is extend
        outputs[label] = [(r["mode"], r["prompt_index"], r["output_ids"], r.get("accept_lengths")) for r in rows]
        for r in rows:
            if r["mode"] != "baseline":  # an extend per verify plus steps - 1 forwards per cycle
                assert len(r["draft_forward_s"]) == r["verify_count"] * 3 + 1
    assert outputs["graph"] == outputs["eager"] == outputs["extend"]
