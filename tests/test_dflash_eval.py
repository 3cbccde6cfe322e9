"""A DFlash drafter's offline τ (eval/offline/dflash_accept.py) on the tiny Llama: the headline is the live chain
walk of eagle3ft/drafter/dflash_walk.py, the per-depth table gives it back, compare's walk counts the same cycles."""

from __future__ import annotations

import pytest
from test_dflash_train import setup  # noqa: F401 (the fixture)

from eagle3ft.drafter.dflash_walk import request_walk
from eagle3ft.eval.offline.dflash_accept import dflash_report, dflash_walk_totals
from eagle3ft.train.validate import tau_from_counts


def test_report_is_the_chain_walk(setup):  # noqa: F811
    drafter, embed, head, batch = setup
    item = {k: v[0] for k, v in batch.items()}
    rep, per_sample = dflash_report(drafter, [item], embed, head)
    T = item["input_ids"].shape[0]
    want = request_walk(drafter, item["aux_hidden"], item["input_ids"], 7, T - 7, embed, head)
    assert rep["headline_tau"] == pytest.approx(want.tau) and rep["roots"] == want.cycles
    assert rep["spec_accept_length"] == pytest.approx(want.spec_accept_length)
    assert rep["all_anchor_tau"] == pytest.approx(want.all_anchor_tau)
    g = rep["greedy"]["per_depth"]
    tau, _ = tau_from_counts([r["accepts"] for r in g], [r["attempts"] for r in g])
    assert tau == pytest.approx(want.tau) and rep["settings"]["3/1/4"]["tau_walk"] == rep["headline_tau"]
    tokens, cycles, free_tokens, free_cycles = dflash_walk_totals(drafter, item, embed, head)
    assert (tokens, cycles) == per_sample[0] and tokens / cycles == pytest.approx(want.tau)
    assert 0 <= free_tokens <= tokens and 0 <= free_cycles <= cycles
