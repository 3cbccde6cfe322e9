"""A tiny random Llama target and a briefly fitted EAGLE-3 drafter, in float64, for the eval tests.

float64 keeps batched (offline, verify) and incremental (decode) forwards far from argmax ties, so
greedy comparisons between them are exact. The drafter is fitted for a few seconds on the target's
own greedy continuations so that drafts are accepted often enough to exercise every path.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.model import DraftCache, Eagle3Drafter
from eagle3ft.eval.decode.speculate import aux_from_hidden_states, greedy_decode

VOCAB, DRAFT_VOCAB, AUX = 320, 160, [0, 1, 2]


def tiny_target(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).double().eval()


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB, (int(torch.randint(6, 14, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


@torch.no_grad()
def features(target, ids: list[int], prompt_len: int, topk: int = 16) -> dict:
    """A store-like item for one sequence: the response (after prompt_len) is the loss-masked part."""
    out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
    lp = F.log_softmax(out.logits[0].double(), dim=-1).topk(topk, dim=-1)
    mask = torch.zeros(len(ids), dtype=torch.long)
    mask[prompt_len:] = 1
    return {
        "input_ids": torch.tensor(ids),
        "loss_mask": mask,
        "aux_hidden": aux_from_hidden_states(out.hidden_states, AUX, target.config)[0],
        "topk_ids": lp.indices,
        "topk_logprobs": lp.values,
    }


def greedy_items(target, ps: list[list[int]], new_tokens: int) -> list[dict]:
    return [features(target, p + greedy_decode(target, p, new_tokens).tokens, len(p)) for p in ps]


def fitted_drafter(target, items: list[dict], steps: int = 200, seed: int = 0) -> Eagle3Drafter:
    """A drafter whose draft vocab is the items' most frequent tokens, fitted on depth 1 (and 2)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        aux_layer_ids=AUX,
        rms_norm_eps=1e-6,
    )
    d = Eagle3Drafter(cfg).double()
    counts = torch.bincount(torch.cat([it["input_ids"] for it in items]), minlength=VOCAB).double()
    counts += torch.rand(VOCAB, generator=torch.Generator().manual_seed(seed)) * 1e-3  # break ties, fill the vocab
    keep = counts.topk(DRAFT_VOCAB).indices.sort().values
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        d.d2t.copy_(keep - torch.arange(DRAFT_VOCAB))
        d.t2d.zero_()
        d.t2d[keep] = True
    t2d_idx = torch.full((VOCAB,), -100, dtype=torch.long)
    t2d_idx[keep] = torch.arange(DRAFT_VOCAB)
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    for it in range(steps):
        item = items[it % len(items)]
        ids, aux = item["input_ids"], item["aux_hidden"]
        T = ids.shape[0]
        cache = DraftCache()
        h, lg = d.step(ids[1:][None], d.fuse(aux[:-1][None]), torch.arange(T - 1)[None], cache)
        labels = t2d_idx[item["topk_ids"][1:, 0]]  # entry t predicts token t+2: target argmax at t+1
        loss = F.cross_entropy(lg[0], labels, ignore_index=-100)
        # depth 2 with the ground-truth token t+2 at position t+1, attending to the prefix <= t and itself
        mask = torch.cat([torch.ones(T - 1, T - 1, dtype=torch.bool).tril(), torch.eye(T - 1, dtype=torch.bool)], dim=1)
        ids2 = torch.cat([ids[2:], ids[-1:]])
        h2, lg2 = d.step(ids2[None], h, torch.arange(1, T)[None], cache, attn_mask=mask[None, None])
        labels2 = torch.cat([t2d_idx[item["topk_ids"][2:, 0]], torch.tensor([-100])])
        loss = loss + 0.8 * F.cross_entropy(lg2[0], labels2, ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


@functools.cache
def tiny_pair() -> tuple[LlamaForCausalLM, Eagle3Drafter]:
    """The shared (target, fitted drafter): fitted once per test session on the seed-1 prompts."""
    target = tiny_target()
    return target, fitted_drafter(target, greedy_items(target, prompts(6, seed=1), 40), steps=120)


def tiny_config_bench(tmp_path: Path, label: str, sets: list[str]) -> tuple[dict, list[dict]]:
    """eval/bench/schedule.py's runs on configs/tiny.yaml with `sets`, in the run folder tmp_path/label, whose export is a
    random tiny drafter (d2t 0: draft id i is target id i) made once in tmp_path/export: (summary, runs.jsonl rows)."""
    from eagle3ft.config import load_config
    from eagle3ft.data.render import load_prompt_sets
    from eagle3ft.drafter.export import export_drafter
    from eagle3ft.eval.bench import live, schedule

    if not (tmp_path / "export").exists():
        torch.manual_seed(0)
        drafter = Eagle3Drafter(DrafterConfig.from_json("configs/drafters/tiny.json"))
        drafter.t2d[: drafter.config.draft_vocab_size] = True
        export_drafter(drafter, tmp_path / "export")
    run = tmp_path / label
    run.mkdir()
    (run / "export").symlink_to(tmp_path / "export")
    cfg = load_config("configs/tiny.yaml", sets)
    backend = live.make_backend(cfg, run)
    summary = schedule.run(
        cfg.eval,
        cfg.bench,
        run,
        backend,
        load_prompt_sets(cfg.target, cfg.bench, backend.tokenizer),
        log=lambda *a: None,
    )
    return summary, [json.loads(x) for x in (run / "bench" / "runs.jsonl").read_text().splitlines()]
