"""A deeper drafter (num_hidden_layers > 1): the forward against SGLang 0.5.17's llama_eagle3.py written out from the
exported tensors, the cache, the TTT unroll against an explicit-mask reference, the export's keys, and a warm start
grown by a layer that keeps the drafter's outputs."""

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
from _eval_tiny import AUX, greedy_items, prompts, tiny_pair
from safetensors.torch import load_file, save_file
from test_train_checkpoint import write_k2_like
from test_train_model import HD, NH, NKV, VD, H, V, hf_config
from test_train_model import make as make_drafter
from test_train_ttt import batch
from train_fixtures import launch, write_store
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, repeat_kv

from eagle3ft.drafter.config import MLA_EAGLE3, DrafterConfig
from eagle3ft.drafter.export import (
    check_keys,
    drafter_tensors,
    export_drafter,
    load_drafter,
    sglang_params,
    sglang_target,
)
from eagle3ft.drafter.model import DraftCache, Eagle3Drafter, export_keys
from eagle3ft.eval.decode.speculate import SpeculativeDecoder, greedy_decode
from eagle3ft.eval.offline.acceptance import SampleInputs, chain_acceptance
from eagle3ft.train.attention import shift
from eagle3ft.train.build import grow_drafter
from eagle3ft.train.ttt import ttt_forward


def make(layers: int, seed: int = 0) -> Eagle3Drafter:
    return make_drafter(seed=seed, layers=layers)  # test_train_model's drafter, norms and vocab set, `layers` deep


def rms(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None):
    """SGLang's RMSNorm(x) or, given a residual, its fused form: (norm(x + residual), x + residual)."""
    if residual is not None:
        x = x + residual
    y = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    return y if residual is None else (y, x)


def engine_forward(tensors: dict, cfg: DrafterConfig, ids, hidden, pos, engine: str = "sglang"):
    """LlamaModel.forward of SGLang 0.5.17's llama_eagle3.py over one causal sequence, from the exported tensors by
    the names its load_weights gives them (midlayer -> layers.0, q/k/v and gate/up stacked). Returns (the aux it hands
    the next draft step: pre-norm, the logits). engine "vllm": vLLM's llama_eagle3.py, the same but for the norm of a
    layer past the first (`self.input_layernorm(hidden_states, residual)` where SGLang has hidden_norm)."""
    params = {}
    for k, w in tensors.items():
        if k in ("d2t", "t2d", "embed_tokens.weight"):
            continue
        name, shard = sglang_target(k, sglang_params(False, cfg.num_hidden_layers))
        params.setdefault(name.replace("model.midlayer.", "model.layers.0."), {})[shard] = w
    p = {
        k: torch.cat([v[s] for s in ("q", "k", "v", "0", "1") if s in v]) if "" not in v else v[""]
        for k, v in params.items()
    }
    B, T = ids.shape
    emb = tensors["embed_tokens.weight"][ids]
    cos, sin = LlamaRotaryEmbedding(hf_config(SimpleNamespace(config=cfg)))(hidden, pos)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    residual = None
    for i in range(cfg.num_hidden_layers):
        L = f"model.layers.{i}"
        if i == 0:  # is_input_layer
            residual = hidden
            x = torch.cat([rms(emb, p[f"{L}.input_layernorm.weight"]), rms(hidden, p[f"{L}.hidden_norm.weight"])], -1)
        else:
            norm = "input_layernorm" if engine == "vllm" else "hidden_norm"
            x, residual = rms(hidden, p[f"{L}.{norm}.weight"], residual)
        q, k, v = (x @ p[f"{L}.self_attn.qkv_proj.weight"].t()).split([NH * HD, NKV * HD, NKV * HD], -1)
        q, k, v = (t.view(B, T, -1, HD).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = repeat_kv(k, NH // NKV), repeat_kv(v, NH // NKV)
        s = (q @ k.transpose(-1, -2) / math.sqrt(HD)).masked_fill(~causal, float("-inf"))
        o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, NH * HD) @ p[f"{L}.self_attn.o_proj.weight"].t()
        x, residual = rms(o, p[f"{L}.post_attention_layernorm.weight"], residual)
        gate, up = (x @ p[f"{L}.mlp.gate_up_proj.weight"].t()).chunk(2, -1)
        hidden = (torch.nn.functional.silu(gate) * up) @ p[f"{L}.mlp.down_proj.weight"].t()
    to_logits, aux = rms(hidden, p["model.norm.weight"], residual)
    return aux, to_logits @ p["lm_head.weight"].t()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_step_matches_each_engines_forward_from_the_export(layers, engine):
    m = make(layers, seed=layers)
    ids, aux = torch.randint(0, V, (2, 7)), torch.randn(2, 7, 3 * H)
    pos = torch.arange(7).expand(2, 7)
    hidden = m.fuse(aux)
    out, logits = m.step(ids, hidden, pos, DraftCache())
    tensors = {**drafter_tensors(m.state_dict()), "embed_tokens.weight": m.embed_tokens.weight}
    ref_out, ref_logits = engine_forward(tensors, m.config, ids, hidden, pos, engine)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def reference_ttt(m: Eagle3Drafter, b: dict, steps: int, decay: float) -> torch.Tensor:
    """The unroll written plainly for any depth: each layer's keys of every step concatenated, an explicit mask
    (step 0 causal, then the row's own key of each later step), full logits, CE against the stored top-k."""
    ids = b["input_ids"]
    B, T = ids.shape
    hidden = m.fuse(b["aux_hidden"])
    pos = torch.arange(T).expand(B, T)
    layers = [m.midlayer, *m.layers.values()]
    keys = [[] for _ in layers]
    t2d = torch.full((V,), -1, dtype=torch.long)
    t2d[torch.arange(VD) + m.d2t] = torch.arange(VD)
    loss = 0.0
    for k in range(steps):
        mask = torch.cat([torch.ones(T, T).tril().bool()] + [torch.eye(T, dtype=torch.bool)] * k, dim=1)
        cos, sin = m.rope(pos + k, hidden.dtype)
        x = hidden
        for i, layer in enumerate(layers):
            if i == 0:
                q, kk, vv = m.qkv(shift(ids, 1 + k), hidden, pos + k)
            else:
                q, kk, vv = layer.qkv(x, cos, sin)
            keys[i].append((kk.repeat_interleave(NH // NKV, 1), vv.repeat_interleave(NH // NKV, 1)))
            kall, vall = (torch.cat([kv[j] for kv in keys[i]], 2) for j in (0, 1))
            s = (q @ kall.transpose(-1, -2) / math.sqrt(HD)).masked_fill(~mask, float("-inf"))
            x = layer.finish(torch.softmax(s, -1) @ vall, x)
        logq = torch.log_softmax(m.logits(x), -1)  # (B, T, Vd)
        tk, lp = shift(b["topk_ids"], 1 + k), shift(b["topk_logprobs"], 1 + k)
        d = t2d[tk]
        pk = lp.exp() * (d >= 0)
        mass = pk.sum(-1, keepdim=True)
        p = torch.zeros(B, T, VD).scatter_add_(-1, d.clamp(min=0), pk / mass.clamp(min=1e-30))
        valid = shift(b["loss_mask"].bool(), 2 + k) & (mass[..., 0] > 0)
        ce = -(p * logq).sum(-1)
        loss = loss + decay**k * (ce * valid).sum() / valid.sum().clamp(min=1)
        hidden = x
    return loss


def test_deeper_ttt_matches_the_explicit_mask_reference_and_its_gradients():
    m = make(2, seed=5)
    b = batch(B=2, T=9, H=H, V=V)
    out = ttt_forward(m, b, steps=3, decay=0.8)
    ref = reference_ttt(m, b, steps=3, decay=0.8)
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-5)
    params = [p for p in m.parameters() if p.requires_grad]
    got = torch.autograd.grad(out.loss, params)
    want = torch.autograd.grad(reference_ttt(m, b, steps=3, decay=0.8), params)
    for (name, _), g, w in zip([(n, p) for n, p in m.named_parameters() if p.requires_grad], got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=name)
    assert any(
        n.startswith("layers.1.") and g.abs().sum() > 0
        for n, g in zip([n for n, p in m.named_parameters() if p.requires_grad], got)
    )


def test_a_deeper_export_round_trips_and_names_sglangs_layers(tmp_path):
    m = make(2, seed=6)
    folder = export_drafter(m, tmp_path / "d")
    back = load_drafter(folder, m.embed_tokens.weight.detach())
    assert back.config.num_hidden_layers == 2
    for k, v in m.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, msg=k)
    keys = set(export_keys(num_layers=2))
    assert {"layers.1.self_attn.q_proj.weight", "layers.1.input_layernorm.weight"} <= keys
    assert sglang_target("layers.1.self_attn.k_proj.weight", sglang_params(False, 2)) == (
        "model.layers.1.self_attn.qkv_proj.weight",
        "k",
    )
    with pytest.raises(ValueError, match="left unfilled.*model.layers.1.mlp.down_proj"):
        check_keys(keys - {"layers.1.mlp.down_proj.weight"}, "t", num_layers=2)
    with pytest.raises(ValueError, match="skipped silently.*layers.1.hidden_norm"):
        check_keys(keys, "t", num_layers=1)
    weights = load_file(folder / "model.safetensors")
    assert torch.equal(weights["layers.1.input_layernorm.weight"], weights["layers.1.hidden_norm.weight"])
    weights["layers.1.input_layernorm.weight"] = weights["layers.1.input_layernorm.weight"] + 1
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match="layers.1.input_layernorm differs from its hidden_norm"):
        load_drafter(folder)


def test_a_warm_start_grown_by_a_layer_keeps_the_drafters_outputs(tmp_path):
    one = make(1, seed=7)
    grown = grow_drafter(one, 2, tmp_path)
    assert grown.config.num_hidden_layers == 2
    ids, hidden = torch.randint(0, V, (1, 6)), torch.randn(1, 6, H)
    pos = torch.arange(6)[None]
    want = one.step(ids, hidden, pos, DraftCache())
    got = grown.step(ids, hidden, pos, DraftCache())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert grow_drafter(one, None, tmp_path) is one and grow_drafter(one, 1, tmp_path) is one
    with pytest.raises(ValueError, match="num_hidden_layers 1 < the warm-start drafter's 2"):
        grow_drafter(grown, 1, tmp_path)


def test_layouts_that_cannot_be_deeper_are_refused():
    with pytest.raises(ValueError, match="1 for Eagle3DeepseekV2ForCausalLM"):
        dataclasses.replace(make(1).config, architecture=MLA_EAGLE3, num_hidden_layers=2).check_supported()
    with pytest.raises(ValueError, match="num_hidden_layers is 0"):
        dataclasses.replace(make(1).config, num_hidden_layers=0).check_supported()


@pytest.mark.slow
def test_a_warm_start_grown_by_a_layer_trains_from_the_drafters_loss_and_exports_it(tmp_path):
    """Through the real entry point under DeepSpeed: the grown drafter's first loss is the 1-layer drafter's, and the
    added layer trains and exports (`drafter.num_hidden_layers=2` on a warm start)."""
    runs = {}
    for layers in (1, 2):
        run = runs[layers] = tmp_path / f"layers-{layers}"
        write_store(run)
        write_k2_like(run / "k2")
        over = (f"drafter.init={run / 'k2'}", f"drafter.num_hidden_layers={layers}", "train.schedule.max_steps=2")
        r = launch(
            run,
            *over,
            "train.schedule.warmup_steps=1",
            "train.optimizer.lr=3e-3",
            "train.objective.ttt_steps=3",
            procs=1,
        )
        assert r.returncode == 0, r.stderr[-4000:]
    first = [json.loads((runs[n] / "train/metrics.jsonl").read_text().splitlines()[0])["loss"] for n in (1, 2)]
    assert first[1] == pytest.approx(first[0], rel=1e-6)
    out = load_file(runs[2] / "export/model.safetensors")
    assert set(out) == set(export_keys(num_layers=2))
    assert out["layers.1.self_attn.o_proj.weight"].abs().sum() > 0  # started at zero, trained
    assert json.loads((runs[2] / "export/config.json").read_text())["num_hidden_layers"] == 2


@pytest.fixture(scope="module")
def deep_pair(tmp_path_factory):
    """The eval tests' fitted tiny drafter grown to 2 layers, its added layer moved off the identity."""
    target, drafter = tiny_pair()
    deep = grow_drafter(drafter, 2, tmp_path_factory.mktemp("deep"))
    torch.manual_seed(3)
    with torch.no_grad():
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            deep.layers["1"].get_submodule(name).weight.normal_(std=0.02)
    return target, deep


def test_deeper_speculation_is_lossless_and_the_offline_walk_equals_live_drafting(deep_pair):
    target, deep = deep_pair
    dec = SpeculativeDecoder(target, deep, AUX, steps=3)
    for p in prompts(2, seed=7):
        assert dec.generate(p, 24).tokens == greedy_decode(target, p, 24).tokens
    offline, live = [], []
    for item in greedy_items(target, prompts(2, seed=1), 24):
        s = SampleInputs.of(item)
        res = chain_acceptance(deep, s, 3)
        ids = s.input_ids.tolist()
        for row in torch.nonzero(res.greedy_valid[:, -1]).flatten().tolist():
            live.append(dec.generate(ids[: row + 1], max_new_tokens=2).accept_lengths[0])
            offline.append(1 + int(torch.cumprod(res.greedy_alpha[row], 0).sum()))
    assert len(live) > 20 and offline == live and max(live) > 1


def test_grow_vocab_keeps_every_token_and_adds_the_most_frequent():
    from eagle3ft.drafter.vocab import build_vocab, grow_vocab

    counts = torch.tensor([5, 0, 9, 1, 7, 3, 8, 2])
    d2t, _ = build_vocab(torch.tensor([0, 9, 0, 0, 0, 0, 0, 9]), 2)  # tokens 1 and 7, both rare in `counts`
    d2t2, t2d2, where = grow_vocab(d2t, counts, 5)
    ids = (torch.arange(5) + d2t2).tolist()
    assert ids == [1, 2, 4, 6, 7]  # 1 and 7 kept, then 2, 6, 4 by count; sorted by id
    assert t2d2.nonzero().flatten().tolist() == ids and where.tolist() == [0, 4]
    with pytest.raises(ValueError, match="draft_vocab_size 1 < the 2 tokens"):
        grow_vocab(d2t, counts, 1)


def test_a_warm_start_grown_in_vocab_keeps_its_rows_and_adds_zero_rows():
    from eagle3ft.train.build import grow_drafter_vocab

    m = make(2, seed=8)
    counts = torch.arange(V).flip(0)  # low ids most frequent
    grown = grow_drafter_vocab(m, VD + 6, counts)
    assert grown.config.draft_vocab_size == VD + 6 and grown.lm_head.weight.shape == (VD + 6, H)
    old_ids = (torch.arange(VD) + m.d2t).tolist()
    new_ids = (torch.arange(VD + 6) + grown.d2t).tolist()
    assert set(old_ids) < set(new_ids) and new_ids == sorted(new_ids)
    hidden, ids = torch.randn(1, 5, H), torch.randint(0, V, (1, 5))
    _, a = m.step(ids, hidden, torch.arange(5)[None], DraftCache())
    _, b = grown.step(ids, hidden, torch.arange(5)[None], DraftCache())
    at = torch.tensor([new_ids.index(t) for t in old_ids])
    torch.testing.assert_close(b[..., at], a)  # the drafter's own tokens: the same logits
    added = sorted(set(range(VD + 6)) - set(at.tolist()))
    assert torch.equal(b[..., added], torch.zeros_like(b[..., added]))  # the added ones: logit 0 until trained


@pytest.mark.slow
def test_a_warm_start_grown_in_vocab_trains_and_exports_it(tmp_path):
    """`drafter.draft_vocab_size` past a warm-start drafter's, through the real entry point: the export and the run's
    vocab hold the drafter's 256 tokens and 128 more of the training answers', and every lm_head row trained."""
    write_store(tmp_path)
    init = write_k2_like(tmp_path / "k2")
    over = (f"drafter.init={tmp_path / 'k2'}", "drafter.draft_vocab_size=384", "train.schedule.max_steps=2")
    r = launch(
        tmp_path,
        *over,
        "train.schedule.warmup_steps=1",
        "train.optimizer.lr=3e-3",
        "train.objective.ttt_steps=3",
        procs=1,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    out = load_file(tmp_path / "export/model.safetensors")
    assert out["lm_head.weight"].shape[0] == 384 and out["d2t"].shape == (384,)
    assert json.loads((tmp_path / "export/config.json").read_text())["draft_vocab_size"] == 384
    old = set((torch.arange(256) + init["d2t"]).tolist())
    new = (torch.arange(384) + out["d2t"]).tolist()
    assert old < set(new) and new == sorted(new)
    assert torch.equal(load_file(tmp_path / "vocab.safetensors")["d2t"], out["d2t"])
    assert (out["lm_head.weight"].float().abs().sum(1) > 0).all()  # the added rows started at zero and moved


@pytest.mark.parametrize("graph_extend", [False, True])
def test_a_deeper_drafters_static_chain_drafts_what_its_eager_chain_drafts(deep_pair, graph_extend):
    """bench.embedded.drafting graph (eval/decode/draft_graph.py, uncaptured on the CPU) over one static cache per layer."""
    from test_eval_draft_graph import _run

    target, deep = deep_pair
    for p in prompts(2, seed=7):
        eager, eager_drafts = _run(target, deep, p, 3, "eager", new=24)
        graph, graph_drafts = _run(target, deep, p, 3, "graph", new=24, graph_extend=graph_extend)
        assert graph_drafts == eager_drafts and graph.tokens == eager.tokens == greedy_decode(target, p, 24).tokens


@pytest.mark.parametrize(
    "size, message",
    [
        (128, "drafter.draft_vocab_size 128 < the warm-start drafter's 256"),
        (384, "growing .* draft vocab to 384 needs the training data's token counts"),
    ],
)
def test_a_warm_start_cannot_shrink_and_grows_only_with_the_datas_counts(tmp_path, size, message):
    from train_fixtures import REPO, TINY_TARGET

    from eagle3ft.config import load_config
    from eagle3ft.train.build import build_drafter

    write_k2_like(tmp_path / "k2")
    cfg = load_config(
        REPO / "configs/tiny.yaml", [f"drafter.init={tmp_path / 'k2'}", f"drafter.draft_vocab_size={size}"]
    )
    with pytest.raises(ValueError, match=message):
        build_drafter(cfg.drafter, cfg.target, tmp_path, TINY_TARGET)  # no token counts given
