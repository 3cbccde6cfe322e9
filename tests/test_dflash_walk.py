"""Offline τ of a DFlash drafter (eagle3ft/drafter/dflash_walk.py): the live chain over anchors, checked by hand, with a
perfect drafter, and against SGLang 0.5.17's decode cycle (tests/sglang_dflash.py) on the tiny Llama target."""

import math

import pytest
import torch
from dflash_fixtures import (
    random_dflash,
    target_features,
    target_head,
    tiny_dflash_config,
    tiny_k2_dflash_config,
    tiny_target,
)
from sglang_dflash import sglang_decode, sglang_load

from eagle3ft.drafter.dflash_model import DraftContext
from eagle3ft.drafter.dflash_walk import accepts, anchor_drafts, request_walk, walk
from eagle3ft.train.dflash_loss import dflash_loss, sample_anchors


def test_the_walk_follows_the_commits_and_differs_from_the_all_anchor_mean():
    acc = [3, 0, 0, 0, 2, 0, 0, 1, 0, 0]  # anchors 10..19
    w = walk(acc, 10, 20)  # 11 tokens generated: positions 10..20
    assert w.anchors == [10, 14, 17, 19] and w.accepted == [3, 2, 1, 0]
    assert w.tau == (4 + 3 + 2 + 1) / 4 == 2.5
    assert w.spec_accept_length == 11 / 4  # 1 + commits (4 + 3 + 2 + 1) over the cycles
    # every anchor: (4 + 1 + 1 + 1 + 3 + 1 + 1 + 2 + 1 + 1) / 10: the walk skips the rejections after good cycles
    assert w.all_anchor_tau == 1.6 and w.all_anchor_tau < w.tau
    last = walk([5, 0, 0, 0, 0, 0], 0, 3)  # the first cycle commits past the last token: one cycle, cut there
    assert last.anchors == [0] and last.tau == 6 and last.spec_accept_length == 4
    assert math.isnan(walk([], 4, 4).tau)  # one generated token (the prefill's): no cycle


def test_drafts_equal_to_the_continuation_give_tau_equal_to_the_block():
    B, P, n = 4, 5, 13
    tokens = torch.arange(100, 100 + P + n + B)  # the continuation, a block past the last generated token
    drafts = torch.stack([tokens[a + 1 : a + B] for a in range(P, P + n - 1)])  # (anchors, B - 1)
    w = walk(accepts(drafts, tokens, P), P, P + n - 1)
    assert w.accepted == [B - 1] * 3 and w.tau == B and w.anchors == [5, 9, 13]  # 1 + 3 x 4 = 13 tokens
    cut = accepts(drafts, tokens[: P + n], P)  # without the tail, the last anchors cannot accept past the end
    assert cut.tolist()[-3:] == [3, 2, 1]  # anchors 14, 15, 16 of 18 tokens


def greedy(target, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, target(ids[None]).logits[0, -1].argmax()[None]])
    return ids


@pytest.mark.parametrize("target_config, steps", [("configs/tiny.yaml", 40), ("configs/tiny-deepseek.yaml", 12)])
def test_the_walk_predicts_sglangs_cycles_exactly_on_the_tiny_targets(target_config, steps):
    """The tiny Llama with a tiny drafter; the tiny DeepSeek-V3 (MLA + MoE) with the K2 drafter's layout, narrowed."""
    target = tiny_target(target_config)
    cfg = tiny_dflash_config(block_size=4) if "deepseek" not in target_config else tiny_k2_dflash_config(4)
    embed, head = target_head(target)
    g = torch.Generator().manual_seed(3)
    P, n = 6, 32  # 8 cycles of a 4-token block generate at most 32 tokens
    prompt = torch.randint(100, 49000, (P,), generator=g)
    text = greedy(target, prompt, n + cfg.block_size)  # the continuation and a block more
    feats, _ = target_features(target, text[None], cfg.target_layer_ids)
    # a drafter trained a little on this text, so that it accepts some drafts and not others
    m = random_dflash(cfg, seed=4, scale=0.05)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    mask = torch.zeros(1, len(text))
    mask[0, P:] = 1
    for _ in range(steps):  # enough to accept some drafts and not all
        loss = dflash_loss(m, feats, text[None], mask, embed, head, sample_anchors(mask, 16, g)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.eval()

    def target_forward(ids):
        f, logits = target_features(target, ids[None], cfg.target_layer_ids)
        return logits[0].argmax(-1), f[0]

    d = cfg.to_hf_dict()
    filled, skipped, unfilled = sglang_load(d, m.state_dict())
    assert not skipped and not unfilled
    cycles, emitted = sglang_decode(d, filled, target_forward, prompt, embed, head, cycles=8)
    assert emitted == text[P : P + len(emitted)].tolist()  # greedy is lossless
    generated = len(emitted)
    w = request_walk(m, feats[0], text, P, generated, embed, head, chunk=5)
    assert w.anchors == [L for L, _, _ in cycles] and w.accepted == [a for _, _, a in cycles]
    assert 0 < sum(w.accepted) < 3 * len(cycles)  # some drafts accepted, not all: the walk is not trivial
    assert w.tau == sum(a + 1 for _, _, a in cycles) / 8
    drafts = anchor_drafts(m, feats[0], text, P, embed, head)  # every anchor's block, SGLang's at the walk's
    assert all(torch.equal(drafts[L - P], sglang_drafts) for L, sglang_drafts, _ in cycles)
    assert embedded_cycles(m, target_forward, prompt, embed, head, 8) == [(L, d.tolist(), a) for L, d, a in cycles]


def embedded_cycles(m, target_forward, prompt, embed, head, n):
    """The same greedy decode with DraftContext as the draft KV: [(L, drafts, accepted)] per cycle."""
    ctx, out = DraftContext(m), []
    predict, feats = target_forward(prompt)
    ctx.append(feats[None])
    committed, bonus = prompt.tolist() + [int(predict[-1])], int(predict[-1])
    for _ in range(n):
        L = ctx.length
        drafts = ctx.draft(torch.tensor([bonus]), embed, head)[0]
        chain = torch.cat([torch.tensor([bonus]), drafts])
        predict, feats = target_forward(torch.cat([torch.tensor(committed[:L]), chain]))
        accept = int((chain[1:] == predict[L:-1]).int().cumprod(0).sum())
        out.append((L, drafts.tolist(), accept))
        committed += drafts[:accept].tolist() + [int(predict[L + accept])]
        ctx.append(feats[None, L : L + accept + 1])
        bonus = int(predict[L + accept])
    return out
