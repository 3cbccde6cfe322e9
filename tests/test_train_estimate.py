"""The flagship-scale estimate: Kimi-K2-shaped drafter on the meta device, and its activation count."""

import json

import pytest
import torch
from train_fixtures import REPO

from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.train.estimate import activation_bytes_per_token_step, estimate, main
from eagle3ft.train.ttt import ttt_forward


def test_kimi_k2_parameter_count_and_memory(capsys):
    raw = json.loads((REPO / "configs/drafters/kimi-k2.json").read_text())
    e = main(["--drafter", str(REPO / "configs/drafters/kimi-k2.json"), "--gpus", "8"])
    H, Ht, I, q, kv = (
        raw["hidden_size"],
        raw["target_hidden_size"],
        raw["intermediate_size"],
        raw["num_attention_heads"] * raw["head_dim"],
        raw["num_key_value_heads"] * raw["head_dim"],
    )
    trainable = 3 * Ht * H + 2 * H * (q + 2 * kv) + q * H + 3 * H * I + 4 * H + H * raw["draft_vocab_size"]
    assert e.trainable_params == trainable
    assert e.frozen_params == raw["vocab_size"] * H
    assert 1.15e9 < e.trainable_params < 1.25e9 and 1.15e9 < e.frozen_params < 1.2e9  # GUIDE: ~1.2B + 1.17B
    assert e.zero3_gib["total"] < e.zero2_gib["total"] < 141  # fits an H200 either way
    for z in (e.zero2_gib, e.zero3_gib):  # the backward's activations and the step's fp32 gradient peak apart
        states = z["weights"] + z["gradients"] + z["optimizer"]
        assert z["total"] == states + max(z["activations"], z["step_fp32_grad"])
        assert z["step_fp32_grad"] == z["optimizer"] / 3  # 4 B against master + moments' 12 B per parameter
    assert e.zero2_gib["weights"] > 2 * (trainable + e.frozen_params) / 2**30 * 0.99  # ZeRO-2 replicates the weights
    out = capsys.readouterr().out
    assert "ZeRO-2" in out and "ZeRO-3" in out and "1.191B trainable" in out


T, K = 96, 3  # tokens and TTT steps of the counts below


def small_bf16_drafter(nkv: int = 8, layers: int = 1) -> tuple[Eagle3Drafter, dict, DrafterConfig]:
    """(a small bf16 drafter of `layers` decoder layers, one batch of T tokens, its config)."""
    cfg = DrafterConfig(
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=nkv,
        head_dim=16,
        intermediate_size=320,
        vocab_size=1000,
        draft_vocab_size=100,
        num_hidden_layers=layers,
    )
    torch.manual_seed(0)
    m = Eagle3Drafter(cfg).to(torch.bfloat16)
    m.t2d[:100] = True
    batch = {
        "input_ids": torch.randint(0, 100, (1, T)),
        "loss_mask": torch.ones(1, T, dtype=torch.long),
        "aux_hidden": torch.randn(1, T, 384).bfloat16(),
        "topk_ids": torch.randint(0, 100, (1, T, 4)),
        "topk_logprobs": torch.log_softmax(torch.randn(1, T, 4), -1),
    }
    return m, batch, cfg


def saved_bytes_per_token_step(compiled: bool, layers: int = 1) -> tuple[float, DrafterConfig]:
    """What autograd keeps per token and TTT step for a small bf16 drafter (eager, or with train.compile's blocks)."""
    m, batch, cfg = small_bf16_drafter(layers=layers)
    if compiled:
        m.compile_blocks()
    if compiled:
        ttt_forward(m, batch, steps=K).loss.backward()  # compile outside the measurement
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ttt_forward(m, batch, steps=K)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params) / (T * K), cfg


@pytest.mark.parametrize("layers", [1, 2])
def test_activation_count_matches_what_autograd_saves(layers):
    """The per-token formula against the bytes autograd really keeps, on a small bf16 drafter of 1 and 2 layers."""
    measured, cfg = saved_bytes_per_token_step(compiled=False, layers=layers)
    assert abs(measured / activation_bytes_per_token_step(cfg) - 1) < 0.15, (
        measured,
        activation_bytes_per_token_step(cfg),
    )


@pytest.mark.slow
def test_compiled_activation_count_matches_what_autograd_saves():
    """train.compile keeps less (its norms and MLP recompute): the compiled formula against autograd's bytes, and the
    drop from eager within 25% of what the formula says compile recomputes."""
    eager, cfg = saved_bytes_per_token_step(compiled=False)
    compiled, _ = saved_bytes_per_token_step(compiled=True)
    formula = activation_bytes_per_token_step(cfg, compiled=True)
    assert abs(compiled / formula - 1) < 0.15, (compiled, formula)
    drop = activation_bytes_per_token_step(cfg) - formula
    assert abs((eager - compiled) / drop - 1) < 0.25, (eager - compiled, drop)


def test_estimate_allocates_nothing():
    """The K2 drafter would need ~9.5 GB in fp32; the estimate must not grow the process by even 1 GB."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    e = estimate(
        DrafterConfig.from_json(REPO / "configs/drafters/kimi-k2.json"), gpus=8, seq=2048, micro_batch=1, ttt_steps=7
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2**20
    assert e.tokens_per_gpu == 2048 and e.largest_param == 163840 * 7168


@pytest.mark.parametrize("layers", [1, 2])
def test_deferred_stash_count_matches_what_the_stash_holds(monkeypatch, layers):
    """deferred_bytes against the most eagle3ft/drafter/wgrad.py's stash holds at once (new tensors only: the output
    gradients and the head's g·x rows; the inputs and softmax - p rows are saved activations already)."""
    from eagle3ft.drafter import wgrad
    from eagle3ft.train.estimate import deferred_bytes

    m, batch, cfg = small_bf16_drafter(nkv=4, layers=layers)
    most = [0]
    grad = wgrad.WeightGradStash.grad

    def counting(self, weight, g, x):
        out = grad(self, weight, g, x)
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for u in self.uses.values() for t in u.g}
        held.update(
            {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for u in self.uses.values()
                if u.weight is m.lm_head.weight
                for t in u.x
            }
        )  # g·x, made in the head's backward
        most[0] = max(most[0], sum(held.values()))
        return out

    monkeypatch.setattr(wgrad.WeightGradStash, "grad", counting)
    ttt_forward(m, batch, steps=K).loss.backward()
    stash, _ = deferred_bytes(cfg, T, K)
    assert abs(most[0] / stash - 1) < 0.1, (most[0], stash)  # the head trains on fewer rows than T at later steps
