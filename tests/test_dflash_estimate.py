"""The DFlash training memory estimate (train/dflash_estimate.py): parameters counted as the module holds them, the
activation count against what autograd really keeps, and the estimate command choosing it by the config's kind."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from dflash_fixtures import tiny_dflash_config
from train_fixtures import REPO

from eagle3ft.drafter.dflash_model import DFlashDrafter, noise_ids
from eagle3ft.train.dflash_estimate import DFlashEstimate, saved_bytes
from eagle3ft.train.dflash_loss import sample_anchors
from eagle3ft.train.estimate import main


def measured_saved_bytes(context: int, anchors: int, layers: int, block: int = 4) -> int:
    """Bytes autograd keeps for one bf16 row through the drafter's training forward (features -> block hidden)."""
    cfg = tiny_dflash_config(block_size=block, num_layers=layers)
    torch.manual_seed(0)
    m = DFlashDrafter(cfg).to(torch.bfloat16)
    embed = torch.randn(1000, cfg.hidden_size).bfloat16()
    tokens = torch.randint(17, 1000, (1, context))
    picked = sample_anchors(torch.ones(1, context, dtype=torch.long), anchors, torch.Generator().manual_seed(0))
    noise = F.embedding(noise_ids(tokens, picked, block, cfg.mask_token_id), embed)
    features = torch.randn(1, context, cfg.num_features * cfg.hidden_size).bfloat16()
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(features, noise, picked)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("context,anchors", [(64, 8), (256, 32), (128, 64)])
@pytest.mark.parametrize("layers", [1, 2])
def test_saved_bytes_match_what_autograd_keeps(context, anchors, layers):
    """Context-heavy and block-heavy rows, one and two layers: the count within 15% of autograd's bytes."""
    got = measured_saved_bytes(context, anchors, layers)
    want = saved_bytes(tiny_dflash_config(block_size=4, num_layers=layers), context, anchors * 4)
    assert abs(got / want - 1) < 0.15, (got, want)


def test_smollm2_and_kimi_dflash_estimates(capsys):
    smol = main(["--drafter", str(REPO / "configs/drafters/smollm2-135m-dflash.json"), "--gpus", "1", "--tied-head"])
    assert isinstance(smol, DFlashEstimate)
    raw = json.loads((REPO / "configs/drafters/smollm2-135m-dflash.json").read_text())
    h, I, L = raw["hidden_size"], raw["intermediate_size"], raw["num_hidden_layers"]
    q, kv, d = (
        raw["num_attention_heads"] * raw["head_dim"],
        raw["num_key_value_heads"] * raw["head_dim"],
        raw["head_dim"],
    )
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * I + 2 * h + 2 * d
    assert smol.trainable_params == L * per_layer + 5 * h * h + 2 * h  # layers, fc (K = 5), hidden_norm, norm
    assert smol.frozen_params == raw["vocab_size"] * h  # a tied target: one V x h tensor
    assert smol.block_tokens == 512 * 16 and smol.context_tokens == 2048
    kimi = main(["--drafter", str(REPO / "configs/drafters/kimi-k25-dflash.json"), "--gpus", "8", "--seq", "3072"])
    assert 3.4e9 < kimi.trainable_params < 3.55e9  # ~6.5 GiB in bf16, as the published drafter's checkpoint
    assert kimi.frozen_params == 2 * 163840 * 7168  # embedding and LM head apart
    for z in (kimi.zero2_gib, kimi.zero3_gib):
        assert z["total"] == z["weights"] + z["gradients"] + z["optimizer"] + max(z["activations"], z["step_fp32_grad"])
    assert kimi.zero3_gib["total"] < kimi.zero2_gib["total"] < 80  # one row of 3072 fits an H100 either way
    out = capsys.readouterr().out
    assert "block tokens" in out and "ZeRO-3" in out
    fewer = main(
        ["--drafter", str(REPO / "configs/drafters/kimi-k25-dflash.json"), "--seq", "3072", "--anchors", "128"]
    )
    assert fewer.saved_bytes_per_row < kimi.saved_bytes_per_row / 2  # the blocks, not the context, dominate
