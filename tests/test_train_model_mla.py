"""The MLA drafter (eagle3ft/drafter/model_mla.py) against SGLang 0.5.17's Eagle3DeepseekV2ForCausalLM: the weights its
loader takes, the forward it computes (absorbed MLA over the latent; both reimplemented in tests/sglang_mla.py),
export/load, warm start and training."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from sglang_mla import sglang_forward, sglang_load, sglang_params
from train_fixtures import REPO, launch, write_store

from eagle3ft.drafter.config import MLA_EAGLE3, DrafterConfig
from eagle3ft.drafter.export import check_keys, drafter_tensors, export_drafter, load_drafter
from eagle3ft.drafter.model import DraftCache
from eagle3ft.drafter.model_mla import Eagle3MLADrafter, mla_export_keys, new_drafter
from eagle3ft.train.attention import shift
from eagle3ft.train.ttt import ttt_forward

TINY_MLA = REPO / "configs/drafters/tiny-mla.json"


def tiny_cfg(**over) -> DrafterConfig:
    raw = json.loads(TINY_MLA.read_text())
    raw.update(over)
    return DrafterConfig.from_dict(raw)


def random_drafter(cfg: DrafterConfig, seed: int = 0) -> Eagle3MLADrafter:
    torch.manual_seed(seed)
    m = new_drafter(cfg)
    chosen = torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values
    with torch.no_grad():
        m.embed_tokens.weight.normal_()
        m.d2t.copy_(chosen - torch.arange(cfg.draft_vocab_size))
        m.t2d[chosen] = True
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("fc_norm", [False, True])
def test_exported_keys_fill_every_sglang_parameter_and_nothing_is_skipped(fc_norm, tmp_path):
    cfg = tiny_cfg(fc_norm=fc_norm)
    m = random_drafter(cfg)
    export_drafter(m, tmp_path / "export")
    weights = load_file(tmp_path / "export" / "model.safetensors")
    assert set(weights) == set(mla_export_keys(fc_norm))
    filled, skipped, hot = sglang_load(cfg, weights)
    assert skipped == [] and set(filled) == set(sglang_params(cfg))
    assert torch.equal(hot, m.draft_to_target(torch.arange(cfg.draft_vocab_size)))
    raw = json.loads((tmp_path / "export" / "config.json").read_text())
    assert raw["architectures"] == [MLA_EAGLE3] and raw["num_hidden_layers"] == 1 and raw["q_lora_rank"] == 48
    for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "draft_vocab_size"):
        assert raw[k] == json.loads(TINY_MLA.read_text())[k], k
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and bool(raw.get("fc_norm")) == fc_norm


def test_key_check_names_what_sglang_would_skip_or_leave_unfilled():
    keys = mla_export_keys()
    check_keys(keys, "t")
    with pytest.raises(ValueError, match="left unfilled.*fused_qkv_a_proj_with_mqa.weight\\[kv_a\\]"):
        check_keys([k for k in keys if "kv_a_proj" not in k], "t")
    with pytest.raises(ValueError, match="skipped silently: \\['midlayer.self_attn.q_proj.weight'\\]"):
        check_keys([*keys, "midlayer.self_attn.q_proj.weight"], "t", architecture=MLA_EAGLE3)


K2_YARN = {  # Kimi-K2's own rope_scaling, with an original length this short test reaches past
    "type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 4,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


@pytest.mark.parametrize("rope_scaling", [None, K2_YARN, {**K2_YARN, "mscale_all_dim": 0.5, "beta_fast": 32}])
def test_step_matches_sglangs_absorbed_mla_on_the_loaded_weights(rope_scaling):
    cfg = tiny_cfg(rope_scaling=rope_scaling)
    m = random_drafter(cfg).double()
    weights = {k: v.double() if v.is_floating_point() else v for k, v in drafter_tensors(m.state_dict()).items()}
    p, _, _ = sglang_load(cfg, weights)
    T = 7
    ids, h, pos = (
        torch.randint(0, cfg.vocab_size, (T,)),
        torch.randn(T, cfg.hidden_size, dtype=torch.float64),
        torch.arange(3, 3 + T),
    )
    ref_out, ref_logits = sglang_forward(cfg, p, m.embed_tokens.weight[ids], h, pos)
    cache = DraftCache()
    with torch.no_grad():
        head, tail = m.step(ids[None, :4], h[None, :4], pos[None, :4], cache)  # a prefix, then the rest over the cache
        feed, logits = m.step(ids[None, 4:], h[None, 4:], pos[None, 4:], cache)
    assert cache.length == T and cache.k.shape == (1, 4, T, 24) and cache.v.shape == (1, 4, T, 24)
    torch.testing.assert_close(torch.cat([head, feed], 1)[0], ref_out, rtol=1e-5, atol=1e-6)  # rope runs in fp32
    torch.testing.assert_close(torch.cat([tail, logits], 1)[0], ref_logits, rtol=1e-5, atol=1e-6)


def test_rope_interleave_false_is_not_the_same_drafter():
    m = random_drafter(tiny_cfg())
    n = new_drafter(tiny_cfg(rope_interleave=False))
    n.load_state_dict(m.state_dict())
    ids, h, pos = torch.randint(0, 49152, (1, 5)), torch.randn(1, 5, 64), torch.arange(5)[None] + 11
    with torch.no_grad():
        assert not torch.allclose(m.step(ids, h, pos, DraftCache())[1], n.step(ids, h, pos, DraftCache())[1])


# --------------------------------------------------------------------------- export, load, refusals, training


def test_export_then_load_round_trips_and_the_loaded_drafter_computes_the_same(tmp_path):
    m = random_drafter(tiny_cfg(norm_output=True))
    export_drafter(m, tmp_path / "a")
    n = load_drafter(tmp_path / "a", m.embed_tokens.weight.detach().clone())
    assert isinstance(n, Eagle3MLADrafter) and n.config.norm_output
    for k, v in m.state_dict().items():
        assert torch.equal(n.state_dict()[k], v), k
    ids, h, pos = torch.randint(0, 49152, (1, 6)), torch.randn(1, 6, 64), torch.arange(6)[None]
    with torch.no_grad():
        for a, b in zip(m.step(ids, h, pos, DraftCache()), n.step(ids, h, pos, DraftCache())):
            assert torch.equal(a, b)
    w = load_file(tmp_path / "a" / "model.safetensors")  # a checkpoint naming the midlayer layers.0 (vLLM's form)
    from safetensors.torch import save_file

    save_file({k.replace("midlayer.", "layers.0."): v for k, v in w.items()}, str(tmp_path / "a" / "model.safetensors"))
    assert torch.equal(
        load_drafter(tmp_path / "a").midlayer.self_attn.kv_b_proj.weight, m.midlayer.self_attn.kv_b_proj.weight
    )


def test_a_config_without_q_lora_rank_is_refused_as_sglang_refuses_it():
    with pytest.raises(ValueError, match="needs q_lora_rank"):
        new_drafter(tiny_cfg(q_lora_rank=None))


def ttt_batch(m, B=2, T=20, K=4, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    hot = m.draft_to_target(torch.arange(m.config.draft_vocab_size))
    ids = hot[torch.randint(0, m.config.draft_vocab_size, (B, T), generator=g)]
    return {
        "input_ids": ids,
        "loss_mask": (torch.rand(B, T, generator=g) > 0.2).long(),
        "aux_hidden": torch.randn(B, T, 3 * m.config.target_hidden_size, generator=g),
        "topk_ids": torch.cat([ids[:, 1:], ids[:, :1]], 1)[..., None].expand(B, T, K).contiguous(),
        "topk_logprobs": torch.log(torch.tensor([0.7, 0.1, 0.1, 0.1])).expand(B, T, K).contiguous(),
    }


def reference_ttt(m, b: dict, steps: int, decay: float) -> torch.Tensor:
    """The unroll written plainly over the MLA drafter's unpadded values: concatenated keys, an explicit
    (T, (k+1)T) mask, full logits; the target puts its top-1 id's probability 0.7 on the next token."""
    ids, (B, T) = b["input_ids"], b["input_ids"].shape
    dv = m.midlayer.self_attn.d.v_head_dim
    hidden, pos = m.fuse(b["aux_hidden"]), torch.arange(T).expand(B, T)
    t2d = torch.full((m.config.vocab_size,), -1, dtype=torch.long)
    t2d[m.draft_to_target(torch.arange(m.config.draft_vocab_size))] = torch.arange(m.config.draft_vocab_size)
    keys, values, loss = [], [], 0.0
    for k in range(steps):
        q, kk, vv = m.qkv(shift(ids, 1 + k), hidden, pos + k)
        keys.append(kk)
        values.append(vv[..., :dv])
        kall, vall = torch.cat(keys, 2), torch.cat(values, 2)  # (B, nh, (k+1)T, dn + dr), (B, nh, (k+1)T, dv)
        mask = torch.cat([torch.ones(T, T).tril().bool()] + [torch.eye(T, dtype=torch.bool)] * k, dim=1)
        att = torch.softmax(
            ((q @ kall.transpose(-1, -2)) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf")), -1
        )
        o = F.pad(att @ vall, (0, q.shape[-1] - dv))
        out = m.midlayer.finish(o, hidden)
        logq = torch.log_softmax(m.logits(out), -1)  # (B, T, Vd)
        nxt = t2d[shift(b["topk_ids"][..., 0], 1 + k)]  # the token the target's row t+1+k puts 0.7 on
        ce = -(logq.gather(-1, nxt.clamp(min=0)[..., None])[..., 0])  # p is one-hot after renormalising
        valid = shift(b["loss_mask"].bool(), 2 + k) & (nxt >= 0)
        loss = loss + decay**k * (ce * valid).sum() / valid.sum()
        hidden = out
    return loss


def test_ttt_unroll_matches_an_explicit_mask_reference_with_gradients():
    m = random_drafter(tiny_cfg(draft_vocab_size=64)).double()
    b = {k: v.double() if v.is_floating_point() else v for k, v in ttt_batch(m).items()}
    b["topk_logprobs"] = torch.log(torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)).expand_as(
        b["topk_logprobs"]
    )
    params = [p for p in m.parameters() if p.requires_grad]
    out = ttt_forward(m, b, steps=4, decay=0.8)
    grads = torch.autograd.grad(out.loss, params)
    ref = reference_ttt(m, b, steps=4, decay=0.8)
    ref_grads = torch.autograd.grad(ref, params)
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-6, atol=1e-7)  # the head's loss runs in fp32
    for (n, _), g, r in zip([x for x in m.named_parameters() if x[1].requires_grad], grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7, msg=n)


def test_ttt_loss_falls_on_the_tiny_mla_drafter():
    m = random_drafter(tiny_cfg(draft_vocab_size=64))
    batch = ttt_batch(m)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        out = ttt_forward(m, batch, steps=3)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert all(p.grad is not None for n, p in m.named_parameters() if p.requires_grad), "a parameter got no gradient"
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.slow
def test_finetune_entry_trains_exports_and_warm_starts_keeping_the_vocab(tmp_path):
    common = (
        "train.schedule.warmup_steps=1",
        "train.optimizer.lr=3e-3",
        "train.objective.ttt_steps=2",
        "train.schedule.max_steps=3",
        "train.checkpoint.save_every=100",
    )
    write_store(tmp_path / "a")
    r = launch(tmp_path / "a", f"drafter.config={TINY_MLA}", *common, procs=1)
    assert r.returncode == 0, r.stderr[-4000:]
    losses = [json.loads(x)["loss"] for x in (tmp_path / "a/train/metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    out = load_file(tmp_path / "a/export/model.safetensors")
    assert set(out) == set(mla_export_keys())
    assert json.loads((tmp_path / "a/export/config.json").read_text())["architectures"] == [MLA_EAGLE3]

    init = random_drafter(tiny_cfg(draft_vocab_size=256), seed=1)  # another vocab than the run's harvest (512)
    export_drafter(init, tmp_path / "init")
    write_store(tmp_path / "b")
    r = launch(tmp_path / "b", f"drafter.init={tmp_path / 'init'}", *common, procs=1)
    assert r.returncode == 0, r.stderr[-4000:]
    out = load_file(tmp_path / "b/export/model.safetensors")
    assert torch.equal(out["d2t"], init.d2t) and torch.equal(out["t2d"], init.t2d)
    assert not torch.equal(
        out["midlayer.self_attn.kv_b_proj.weight"], init.midlayer.self_attn.kv_b_proj.weight.detach()
    )
    assert torch.equal(load_file(tmp_path / "b/vocab.safetensors")["d2t"], init.d2t)


def test_k2_width_mla_config_builds_on_meta_and_estimates():
    from eagle3ft.train.estimate import main

    raw = json.loads((REPO / "configs/drafters/kimi-k2-mla.json").read_text())
    e = main(["--drafter", str(REPO / "configs/drafters/kimi-k2-mla.json"), "--gpus", "8"])
    H, I, nh, Vd = raw["hidden_size"], raw["intermediate_size"], raw["num_attention_heads"], raw["draft_vocab_size"]
    ql, r, dn, dr, dv = (
        raw[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    attn = 2 * H * (ql + r + dr) + ql * nh * (dn + dr) + r * nh * (dn + dv) + nh * dv * H + ql + r
    assert e.trainable_params == 3 * H * H + attn + 3 * H * I + 4 * H + H * Vd  # ~0.90B, MLA's projections 0.13B
    assert e.frozen_params == raw["vocab_size"] * H


def test_heldout_tau_of_the_ttt_unroll_equals_the_offline_chain_through_step():
    """The TTT unroll (training, held-out τ) and eval/offline/accept_len.py's chain through `step` (inference) count the same
    accepts on the tiny target's greedy answers, with an MLA drafter fitted briefly so that chains get accepted."""
    from _eval_tiny import AUX, DRAFT_VOCAB, VOCAB, greedy_items, prompts, tiny_target

    from eagle3ft.data.store import collate
    from eagle3ft.eval.offline.accept_len import evaluate
    from eagle3ft.train.ttt import TTTObjective
    from eagle3ft.train.validate import heldout_tau

    target = tiny_target()
    items = greedy_items(target, prompts(3, seed=1), 30)
    items = [{**it, "sample_id": torch.tensor(i)} for i, it in enumerate(items)]
    torch.manual_seed(0)
    m = new_drafter(tiny_cfg(vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, rms_norm_eps=1e-6)).double()
    counts = torch.bincount(torch.cat([it["input_ids"] for it in items]), minlength=VOCAB).double()
    keep = (counts + torch.rand(VOCAB, generator=torch.Generator().manual_seed(0)) * 1e-3).topk(DRAFT_VOCAB).indices
    keep = keep.sort().values
    with torch.no_grad():
        m.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        m.d2t.copy_(keep - torch.arange(DRAFT_VOCAB))
        m.t2d[keep] = True
    objective = TTTObjective(m, steps=3, decay=0.8)
    batch = {k: v.double() if v.is_floating_point() else v for k, v in collate(items).items()}
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(40):
        opt.zero_grad()
        objective(batch).loss.backward()
        opt.step()
    m.eval()
    assert m.config.aux_layer_ids == AUX
    rep = evaluate(m, items, 4)
    res = heldout_tau(
        TTTObjective(m, steps=7, decay=0.8), [collate(items[:2]), collate(items[2:])], 4, step=1, device="cpu"
    )
    table = rep.greedy["per_depth"]
    assert res.chain_valid == pytest.approx([r["attempts"] for r in table], abs=1e-9)
    assert res.chain_correct == pytest.approx([r["accepts"] for r in table], abs=1e-9)
    assert res.heldout_tau == pytest.approx(rep.greedy["tau"], abs=1e-12)
    assert rep.greedy["tau"] > 1.3, rep.greedy["tau"]
