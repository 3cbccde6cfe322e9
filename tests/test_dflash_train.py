"""The trainer's DFlash objective on the tiny Llama: held-out τ is the live chain walk, the anchors' draw follows the
batch's place in the run, the chunked cross-entropy equals the whole one, a store of the wrong kind is refused."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from dflash_fixtures import random_dflash, target_features, tiny_dflash_config, tiny_target

from eagle3ft.config import REPO_ROOT, load_config
from eagle3ft.drafter.dflash_walk import request_walk, walk
from eagle3ft.train.dflash_loss import dflash_loss, sample_anchors
from eagle3ft.train.dflash_objective import DFlashObjective, build_dflash, walk_counts
from eagle3ft.train.validate import heldout_view, tau_from_counts


def test_walk_counts_give_the_walks_tau():
    rng = random.Random(0)
    for _ in range(50):
        acc = [rng.randint(0, 5) for _ in range(40)]
        w = walk(acc, 0, 40)
        c, v = walk_counts(w.accepted, 5)
        assert tau_from_counts(c, v)[0] == pytest.approx(w.tau)


@pytest.fixture(scope="module")
def setup():
    model = tiny_target()
    cfg = tiny_dflash_config(block_size=4)
    drafter = random_dflash(cfg, scale=0.2)
    torch.manual_seed(1)
    prompt = torch.randint(100, 2000, (7,))
    with torch.no_grad():  # the target's greedy continuation: the walk's text
        ids = prompt[None]
        for _ in range(17):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
    feats, _ = target_features(model, ids, [0, 1, 2])
    embed = model.get_input_embeddings().weight.detach()
    head = model.lm_head.weight.detach()
    mask = torch.zeros_like(ids)
    mask[:, 7:] = 1
    batch = {"input_ids": ids, "loss_mask": mask, "aux_hidden": feats}
    return drafter, embed, head, batch


def test_heldout_tau_is_the_chain_walk(setup):
    drafter, embed, head, batch = setup
    obj = DFlashObjective(drafter, embed, head, num_anchors=8)
    out = obj(heldout_view(batch), steps=3)
    tau, _ = tau_from_counts(out.chain_correct.tolist(), out.chain_valid.tolist())
    T = batch["input_ids"].shape[1]
    want = request_walk(drafter, batch["aux_hidden"][0], batch["input_ids"][0], 7, T - 7, embed, head)
    assert want.cycles > 1 and tau == pytest.approx(want.tau)


def test_anchor_draw_follows_the_batchs_place(setup):
    drafter, embed, head, batch = setup
    obj = DFlashObjective(drafter, embed, head, num_anchors=3, seed=5)
    place = {"draw": torch.tensor([0, 2, 0])}
    a = obj({**batch, **place}).loss
    assert obj({**batch, **place}).loss == a
    assert obj({**batch, "draw": torch.tensor([1, 2, 0])}).loss != a


def test_chunked_ce_equals_the_whole(setup):
    drafter, embed, head, batch = setup
    anchors = sample_anchors(batch["loss_mask"], 6, torch.Generator().manual_seed(0))
    grads = []
    for chunk in (None, 5):
        drafter.zero_grad()
        out = dflash_loss(
            drafter, batch["aux_hidden"], batch["input_ids"], batch["loss_mask"], embed, head, anchors, 7.0, chunk
        )
        out.loss.backward()
        grads.append((out.loss.detach(), drafter.fc.weight.grad.clone(), out.correct))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])
    assert torch.equal(grads[0][2], grads[1][2])


def test_eagle3_features_refused_in_one_line(tmp_path):
    cfg = load_config(REPO_ROOT / "configs/tiny.yaml", ["drafter.config=configs/drafters/tiny-dflash.json"])
    spec = dataclasses.replace(tiny_dflash_config(), block_size=4)
    identity = {"hidden_size": 64, "vocab_size": 49152, "num_layers": 4, "aux_layer_ids": [0, 1, 2]}
    with pytest.raises(ValueError) as e:
        build_dflash(cfg.drafter, cfg.train.objective, tmp_path, identity, spec)
    assert "harvested for an eagle3 drafter" in str(e.value) and "\n" not in str(e.value)
    dflash_identity = {**identity, "capture": {"kind": "dflash", "hidden_states": [1, 2, 3]}}
    assert build_dflash(cfg.drafter, cfg.train.objective, tmp_path, dflash_identity, spec).config.block_size == 4


def test_warm_start_from_a_published_folder(tmp_path):
    from safetensors.torch import load_file, save_file

    from eagle3ft.drafter import dflash_export
    from eagle3ft.train.dflash_objective import check_dflash_run

    published = random_dflash(tiny_dflash_config(block_size=4), seed=7).float()
    folder = dflash_export.save(published, tmp_path / "published")
    tensors = {f"model.{k}": v for k, v in load_file(str(folder / "model.safetensors")).items()}
    tensors["embed_tokens.weight"] = torch.zeros(8, 64)  # a tensor SGLang ignores: dropped, not refused
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = load_config(
        REPO_ROOT / "configs/tiny.yaml",
        ["drafter.config=configs/drafters/tiny-dflash.json", f"drafter.init={folder}"],
    )
    identity = {
        "hidden_size": 64,
        "vocab_size": 49152,
        "num_layers": 4,
        "aux_layer_ids": [0, 1, 2],
        "capture": {"kind": "dflash", "hidden_states": [1, 2, 3]},
    }
    model = build_dflash(cfg.drafter, cfg.train.objective, tmp_path, identity, tiny_dflash_config())
    for k, v in published.state_dict().items():
        assert torch.equal(model.state_dict()[k], v)
    with pytest.raises(ValueError, match="train.pack_tokens with a DFlash drafter"):
        check_dflash_run(load_config(REPO_ROOT / "configs/tiny.yaml", ["train.batch.pack_tokens=256"]).train)
