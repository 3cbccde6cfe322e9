"""bench.embedded.attention: chain (eval/decode/chain_attention.py): the same logits as transformers' sdpa for every forward the
embedded decoders make, the same greedy speculative output, and fewer aten ops per verify."""

from __future__ import annotations

import copy

import pytest
import torch
from _eval_tiny import AUX, prompts, tiny_config_bench, tiny_pair
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from eagle3ft.eval.decode import chain_attention
from eagle3ft.eval.decode.speculate import SpeculativeDecoder, greedy_decode


def _forwards(model, prompt, steps):
    """Logits of a prefill, a one-token step and a 5-token verify after the cache, as the decoders make them."""
    cache, out = DynamicCache(), []
    with torch.no_grad():
        out.append(model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits)
        out.append(model(input_ids=torch.tensor([steps[:1]]), past_key_values=cache, use_cache=True).logits)
        out.append(model(input_ids=torch.tensor([steps[1:]]), past_key_values=cache, use_cache=True).logits)
    return out


def test_chain_attention_gives_sdpas_logits_and_greedy_output():
    target, drafter = tiny_pair()
    chained = copy.deepcopy(target)
    chain_attention.use(chained, "chain")
    assert chained.config._attn_implementation == chain_attention.NAME
    assert target.config._attn_implementation == "sdpa"  # the copy switched, not the original
    for p in prompts(3):
        for a, b in zip(_forwards(target, p, [5, 6, 7, 8, 9, 10]), _forwards(chained, p, [5, 6, 7, 8, 9, 10])):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        want = greedy_decode(target, p, 20).tokens
        assert greedy_decode(chained, p, 20).tokens == want
        assert SpeculativeDecoder(chained, drafter, AUX, steps=3).generate(p, 20).tokens == want


def _aten_ops(model, q: int) -> int:
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([list(range(40))]), past_key_values=cache, use_cache=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(input_ids=torch.tensor([list(range(q))]), past_key_values=cache, use_cache=True)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def test_a_verify_makes_fewer_aten_ops_with_chain_attention():
    target, _ = tiny_pair()
    chained = copy.deepcopy(target)
    chain_attention.use(chained, "chain")
    sdpa, chain = _aten_ops(target, 6), _aten_ops(chained, 6)
    assert chain < sdpa - 5 * target.config.num_hidden_layers, (sdpa, chain)  # the per-layer mask and head repeats
    assert _aten_ops(chained, 1) <= _aten_ops(target, 1)  # a plain step costs no more


def test_chain_attention_refuses_batches_and_unknown_names():
    target, _ = tiny_pair()
    chained = copy.deepcopy(target)
    chain_attention.use(chained, "chain")
    with pytest.raises(ValueError, match="one sequence at a time"):
        chained(input_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="bench.embedded.attention 'flash'"):
        chain_attention.use(target, "flash")


def test_the_embedded_bench_with_chain_attention_decodes_what_sdpa_decodes(tmp_path):
    """bench.embedded.attention chain through the embedded backend of eval/bench/live.py on the tiny config: the same output ids
    per prompt and pass as with sdpa, and the summary names the attention."""
    outputs = {}
    for attention in ("sdpa", "chain"):
        sets = [
            "bench.prompts.limit=2",
            "bench.max_new_tokens=6",
            "bench.repetitions=1",
            f"bench.embedded.attention={attention}",
        ]
        summary, rows = tiny_config_bench(tmp_path, attention, sets)
        assert summary["environment"]["attention"] == {"sdpa": "sdpa", "chain": chain_attention.NAME}[attention]
        outputs[attention] = [(r["mode"], r["prompt_index"], r["output_ids"]) for r in rows]
    assert outputs["chain"] == outputs["sdpa"]
