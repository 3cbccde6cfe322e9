"""The embedded DFlash decoder (eval/decode/dflash_decode.py) on the tiny Llama: its output is plain greedy decoding,
and its cycles are the offline chain walk's (eagle3ft/drafter/dflash_walk.py) on the same tokens."""

from __future__ import annotations

import torch
from dflash_fixtures import random_dflash, target_features, tiny_dflash_config, tiny_target

from eagle3ft.drafter.dflash_walk import request_walk
from eagle3ft.eval.decode.dflash_decode import DFlashDecoder
from eagle3ft.eval.decode.speculate import greedy_decode

PROMPT = [100, 200, 300, 400]  # the tiny target's greedy answer loops on 32905 and 16439
LOOP = 32905


def always_drafts(token: int, model, block_size: int = 4):
    """A drafter whose layers add nothing (o_proj, down_proj zero), so every mask position's hidden is the mask
    embedding normalised, scaled by a final norm that points it at `token`'s LM-head row: it drafts `token` always."""
    drafter = random_dflash(tiny_dflash_config(block_size=block_size))
    emb = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    m = emb[drafter.config.mask_token_id]
    n = m / m.pow(2).mean().add(drafter.config.rms_norm_eps).sqrt()
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        drafter.norm.weight.copy_(head[token] * n)
    return drafter


def test_output_is_greedy_and_cycles_are_the_offline_walk():
    model = tiny_target()
    plain = greedy_decode(model, PROMPT, 40).tokens
    for drafter, hits in ((always_drafts(LOOP, model), True), (random_dflash(tiny_dflash_config(), seed=3), False)):
        g = DFlashDecoder(model, drafter).generate(PROMPT, 40)
        assert g.tokens == plain
        assert (max(g.accept_lengths) > 1) == hits  # the looping drafter has whole blocks accepted
        ids = torch.tensor([PROMPT + plain])
        feats, _ = target_features(model, ids, drafter.config.target_layer_ids)
        emb = model.get_input_embeddings().weight.detach()
        head = model.get_output_embeddings().weight.detach()
        w = request_walk(drafter, feats[0], ids[0], len(PROMPT), len(plain), emb, head)
        assert g.verify_count == w.cycles
        assert g.accept_lengths[:-1] == [a + 1 for a in w.accepted[:-1]]  # the last cycle is cut at 40 tokens
        assert len(plain) / g.verify_count == w.spec_accept_length
