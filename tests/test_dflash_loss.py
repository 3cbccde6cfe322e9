"""The DFlash block objective (train/dflash_loss.py) on the tiny random Llama target: anchors, weights, labels and the
batched loss against a loop of single-block drafts."""

import math

import pytest
import torch
import torch.nn.functional as F
from dflash_fixtures import MASK_ID, random_dflash, target_features, target_head, tiny_dflash_config, tiny_target

from eagle3ft.train.dflash_loss import (
    anchor_candidates,
    decay_weights,
    dflash_loss,
    position_weights,
    sample_anchors,
)


def test_anchors_are_sorted_unique_supervised_and_uniform():
    mask = torch.zeros(2, 20, dtype=torch.uint8)
    mask[0, 5:12] = 1  # candidates 5..10 (11's next token is not supervised)
    mask[1, 2:4] = 1
    mask[1, 15:20] = 1  # candidates 2, 15..18 (19 has no next token)
    assert anchor_candidates(mask)[0].nonzero()[:, 0].tolist() == list(range(5, 11))
    assert anchor_candidates(mask)[1].nonzero()[:, 0].tolist() == [2, 15, 16, 17, 18]
    g = torch.Generator().manual_seed(0)
    seen = torch.zeros(20)
    for _ in range(300):
        a = sample_anchors(mask, 3, g)
        assert a.shape == (2, 3)
        for b, row in enumerate(a):
            assert row.tolist() == sorted(set(row.tolist())) and bool(anchor_candidates(mask)[b, row].all())
        seen[a[0]] += 1
    hit = seen[5:11]
    assert hit.sum() == 900 and hit.min() > 100 and hit.max() < 200  # 150 each expected
    everything = sample_anchors(mask, 512, g)
    assert everything[0].tolist() == list(range(5, 11)) and everything[1].tolist() == [2, 15, 16, 17, 18, -1]


def test_weights_decay_from_the_first_drafted_position_and_follow_the_labels_mask():
    mask = torch.ones(1, 10)
    mask[0, 7] = 0
    w, pos = position_weights(torch.tensor([[5, -1]]), mask, 4, gamma=7.0)
    d = decay_weights(4)
    assert d[:2] == [0.0, 1.0] and math.isclose(d[2], math.exp(-1 / 7))
    assert torch.allclose(w[0, 0], torch.tensor([0.0, 1.0, 0.0, math.exp(-2 / 7)]))  # label 7 unsupervised
    assert w[0, 1].sum() == 0  # padding anchor
    w, _ = position_weights(torch.tensor([[8]]), torch.ones(1, 10), 4, gamma=7.0)
    assert torch.allclose(w[0, 0], torch.tensor([0.0, 1.0, 0.0, 0.0]))  # positions 10, 11 are past the end


def test_batched_loss_equals_a_loop_of_single_block_drafts_on_the_tiny_target():
    target = tiny_target()
    cfg = tiny_dflash_config()
    m = random_dflash(cfg, seed=1)
    embed, head = target_head(target)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, 49000, (2, 18), generator=g)
    mask = torch.zeros(2, 18)
    mask[0, 6:] = 1
    mask[1, 4:15] = 1
    feats, _ = target_features(target, tokens, cfg.target_layer_ids)
    anchors = sample_anchors(mask, 5, g)
    out = dflash_loss(m, feats, tokens, mask, embed, head, anchors)
    num, den, correct = 0.0, 0.0, torch.zeros(3)
    for b in range(2):
        for a in anchors[b].tolist():
            ids = torch.tensor([tokens[b, a].item()] + [MASK_ID] * 3)
            with torch.no_grad():  # one block, context 0..a-1 only: SGLang's cycle at L = a
                h = m(feats[b : b + 1, :a], embed[ids][None], torch.tensor([[a]]))[0]
            for k in range(1, 4):
                if a + k >= 18 or not mask[b, a + k]:
                    continue
                w = math.exp(-(k - 1) / 7)
                logits = h[k] @ head.t()
                num += w * F.cross_entropy(logits[None], tokens[b, a + k][None]).item()  # its own position's token
                den += w
                correct[k - 1] += float(logits.argmax() == tokens[b, a + k])
    assert math.isclose(out.loss.item(), num / den, rel_tol=1e-7)  # weights are float32
    assert math.isclose(out.weight_sum.item(), den, rel_tol=1e-6)
    assert torch.equal(out.correct, correct)


def test_the_loss_trains_the_drafter_and_leaves_the_target_alone():
    target = tiny_target()
    cfg = tiny_dflash_config()
    m = random_dflash(cfg, seed=2, scale=0.05).float()
    embed, head = (t.float() for t in target_head(target))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(100, 49000, (1, 24), generator=g)
    tokens[0, 12:] = tokens[0, :12]  # a repeat the draft can learn from the context
    mask = torch.ones(1, 24)
    feats, _ = target_features(target, tokens, cfg.target_layer_ids)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    first, first_acc = None, None
    for _ in range(40):
        out = dflash_loss(m, feats.float(), tokens, mask, embed, head, sample_anchors(mask, 8, g))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        first = first if first is not None else out.loss.item()
        first_acc = first_acc if first_acc is not None else out.acc.mean().item()
    # the random target's head is flat (loss near log V at best), so the drafter's learning shows in the accuracy
    assert first_acc < 0.2 and out.acc.min().item() == 1.0 and out.loss.item() < first - 1.0
    assert not embed.requires_grad and not head.requires_grad
    assert all(p.grad is not None for p in m.parameters())


def test_a_batch_with_nothing_supervised_gives_a_zero_loss_with_every_gradient_and_bf16_runs():
    cfg = tiny_dflash_config()
    m = random_dflash(cfg).float()
    g = torch.Generator().manual_seed(0)
    embed, head = torch.randn(49152, 64, generator=g), torch.randn(49152, 64, generator=g)
    tokens, mask = torch.randint(0, 49152, (2, 10), generator=g), torch.zeros(2, 10)
    anchors = sample_anchors(mask, 4, g)
    assert anchors.shape == (2, 0)
    out = dflash_loss(m, torch.randn(2, 10, 192, generator=g), tokens, mask, embed, head, anchors)
    out.loss.backward()
    assert out.loss.item() == 0 and out.count.sum() == 0 and all(p.grad is not None for p in m.parameters())
    mask[:, 3:] = 1
    b = m.to(torch.bfloat16)
    feats = torch.randn(2, 10, 192, generator=g).bfloat16()
    out = dflash_loss(b, feats, tokens, mask, embed.bfloat16(), head.bfloat16(), sample_anchors(mask, 4, g))
    out.loss.backward()
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss) and out.count.sum() > 0


@pytest.mark.parametrize("config", ["configs/tiny.yaml", "configs/tiny-deepseek.yaml"])
def test_feature_j_is_the_output_of_target_layer_j(config):
    """The harvest's numbering for DFlash: id j is what decoder layer j returns (the residual stream entering j + 1),
    which transformers lists at hidden_states[j + 1]; on both tiny targets."""
    target = tiny_target(config)
    cfg = tiny_dflash_config()
    outputs = {}
    hooks = [
        layer.register_forward_hook(
            lambda mod, args, out, j=j: outputs.__setitem__(j, out[0] if isinstance(out, tuple) else out)
        )
        for j, layer in enumerate(target.model.layers)
    ]
    ids = torch.randint(100, 49000, (1, 9))
    feats, _ = target_features(target, ids, cfg.target_layer_ids)
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    for h in hooks:
        h.remove()
    assert cfg.hidden_state_indices() == [1, 2, 3]
    want = torch.cat([outputs[j] for j in cfg.target_layer_ids], -1)
    assert torch.equal(feats, want) and torch.equal(feats, torch.cat([hs[i] for i in cfg.hidden_state_indices()], -1))
