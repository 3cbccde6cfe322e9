"""The model side of the SGLang protocol double (tests/sglang_double.py, which says what it mirrors): generation,
hidden states, logprobs and speculative counters, computed by the real embedded model."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import torch

from eagle3ft.drafter.dflash_model import DFlashDrafter
from eagle3ft.eval.decode.speculate import aux_from_hidden_states


def model_eos(model, tokenizer) -> set[int]:
    """The tokenizer's and the generation config's end-of-sequence ids: where the server stops unless ignore_eos."""
    eos = tokenizer.eos_token_id
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return {
        int(e)
        for e in ([eos] if eos is not None else [])
        + (list(gen_eos) if isinstance(gen_eos, (list, tuple)) else [gen_eos] if gen_eos is not None else [])
    }


def _bf16_rows(x: torch.Tensor) -> list:
    return x.to(torch.bfloat16).float().tolist()


def _top(logprobs: torch.Tensor, k: int) -> list:
    """(T, V) log-probabilities -> per position K [logprob, id, null], sorted descending."""
    v, i = logprobs.topk(k, dim=-1)
    return [[[lp, tid, None] for lp, tid in zip(vr, ir)] for vr, ir in zip(v.tolist(), i.tolist())]


class DoubleEngine:
    """The model side: generation, hidden states, logprobs, speculative counters."""

    def __init__(
        self,
        model,
        tokenizer,
        aux_layer_ids: list[int] | None = None,
        drafter=None,
        spec_steps: int = 3,
        spec_topk: int = 1,
        spec_num_draft_tokens: int = 4,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.drafter = drafter
        self.thresholds = (1.0, 1.0)  # --speculative-accept-threshold-single/acc, read by the DFLASH sampled verify
        if isinstance(drafter, DFlashDrafter):  # DFLASH: one block of B a cycle, reported as 1/1/B
            block = drafter.config.block_size
            if spec_num_draft_tokens != block:
                raise ValueError(
                    f"the double mirrors a DFLASH server at its drafter's block {block}, got num_draft_tokens "
                    f"{spec_num_draft_tokens}"
                )
            self.aux_layer_ids, self.spec = None, (1, 1, block)
            self.lock, self.spec_tokens, self.spec_verifies = threading.Lock(), 0, 0
            self.model_eos = model_eos(model, tokenizer)
            return
        self.aux_layer_ids = (
            list(drafter.config.aux_layer_ids)
            if drafter is not None
            else (list(aux_layer_ids) if aux_layer_ids else None)
        )
        if drafter is not None:
            if spec_topk != 1 or spec_num_draft_tokens != spec_steps + 1:
                raise ValueError(
                    "the double mirrors chain drafting only (topk 1, num_draft_tokens = steps + 1), got "
                    f"{spec_steps}/{spec_topk}/{spec_num_draft_tokens}"
                )
            if self.aux_layer_ids is None:
                raise ValueError("the draft model's config names no eagle_aux_hidden_state_layer_ids")
        self.spec = (spec_steps, spec_topk, spec_num_draft_tokens)
        self.model_eos = model_eos(model, tokenizer)
        self.lock = threading.Lock()
        self.spec_tokens = 0
        self.spec_verifies = 0

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    @property
    def algorithm(self) -> str | None:
        """SGLang's speculative_algorithm for this engine's draft (None: plain)."""
        if self.drafter is None:
            return None
        return "DFLASH" if isinstance(self.drafter, DFlashDrafter) else "EAGLE3"

    def _generate(self, ids: list[int], sp: dict):
        from eagle3ft.eval.bench.embedded_backend import (
            TimedDFlashDecoder,
            TimedPlainDecoder,
            TimedSpeculativeDecoder,
        )

        max_new = int(sp.get("max_new_tokens", 128))
        temperature = float(sp.get("temperature", 1.0))
        stops = set(int(i) for i in sp.get("stop_token_ids") or []) | (
            set() if sp.get("ignore_eos") else self.model_eos
        )
        gen = torch.Generator().manual_seed(int(sp.get("sampling_seed", 0)))
        if max_new == 0:
            return [], None, None
        if self.drafter is None:
            g, timings = TimedPlainDecoder(self.model, stops, temperature, gen).timed_generate(ids, max_new)
            return g.tokens, None, timings
        if self.algorithm == "DFLASH":
            dec = TimedDFlashDecoder(self.model, self.drafter, stops, temperature, gen, *self.thresholds)
            g, timings = dec.timed_generate(ids, max_new)
            return g.tokens, g, timings
        steps = self.spec[0]
        dec = TimedSpeculativeDecoder(self.model, self.drafter, self.aux_layer_ids, steps, temperature, stops, gen)
        g, timings = dec.timed_generate(ids, max_new)
        return g.tokens, g, timings

    def generate_batch(self, req: dict) -> list[tuple[dict, list[tuple[float, int]]]]:
        """A batched /generate: one answer per prompt, in order; `sampling_params` one dict for all or one per
        prompt."""
        if req.get("stream"):
            raise BadRequest("the double does not mirror streamed batches")
        prompts = req.get("input_ids") if req.get("input_ids") is not None else req.get("text")
        sps = req.get("sampling_params")
        if isinstance(sps, list) and len(sps) != len(prompts):
            raise BadRequest(f"sampling_params has {len(sps)} entries for {len(prompts)} prompts")
        key = "input_ids" if req.get("input_ids") is not None else "text"
        per = [
            {**req, key: p, "sampling_params": sps[i] if isinstance(sps, list) else sps} for i, p in enumerate(prompts)
        ]
        if key == "input_ids":
            per = [{k: v for k, v in r.items() if k != "text"} for r in per]
        return [self.generate(r) for r in per]

    @torch.no_grad()
    def generate(self, req: dict) -> tuple[dict, list[tuple[float, int]]]:
        """(the answer, its stream timeline): chunks of (seconds after the previous chunk, new tokens),
        replaying the embedded decoder's measured decode (per verify cycle, or per token when plain)."""
        t0 = time.time()
        if self.algorithm == "DFLASH":  # SGLang 0.5.17 aborts these with 400 (speculative/dflash_utils.py:843-850)
            if req.get("return_logprob"):
                raise BadRequest("DFLASH speculative decoding does not support return_logprob yet.")
            if req.get("return_hidden_states"):  # refused under the overlap schedule, SGLang's default
                raise BadRequest("DFLASH speculative decoding does not support return_hidden_states yet.")
        if req.get("stream") and (req.get("return_hidden_states") or req.get("return_logprob")):
            raise BadRequest("the double does not mirror streamed hidden states or logprobs")
        ids = req.get("input_ids")
        if ids is None:
            if req.get("text") is None:
                raise BadRequest("Either text or input_ids should be provided.")
            ids = self.tokenizer.encode(req["text"])
        if isinstance(ids[0], list):
            raise BadRequest("the double does not mirror batched /generate")
        ids = [int(i) for i in ids]
        sp = dict(req.get("sampling_params") or {})
        with self.lock:
            tokens, spec, timings = self._generate(ids, sp)
            fed = ids + tokens[:-1]  # the last generated token is never fed back
            out = self.model(input_ids=torch.tensor([fed]), output_hidden_states=True, use_cache=False)
            logits = out.logits[0].float()
            temperature = float(sp.get("temperature", 1.0))
            logprobs_in = torch.log_softmax(logits, dim=-1)
            logprobs_out = torch.log_softmax(logits / temperature, dim=-1) if temperature > 0 else logprobs_in
            if self.aux_layer_ids is not None:
                rows = aux_from_hidden_states(out.hidden_states, self.aux_layer_ids, self.model.config)[
                    0
                ]  # SGLang's rule
            else:
                rows = out.hidden_states[-1][0]  # transformers' last entry is the final-norm output
            if spec is not None:
                self.spec_tokens += len(tokens)
                self.spec_verifies += spec.verify_count
        P, N = len(ids), len(tokens)
        finished_by_stop = (
            N > 0
            and (tokens[-1] in (set(int(i) for i in sp.get("stop_token_ids") or []) | self.model_eos))
            and not sp.get("ignore_eos")
        )
        meta: dict[str, Any] = {
            "id": req.get("rid") or uuid.uuid4().hex,
            "finish_reason": {"type": "stop", "matched": tokens[-1]}
            if finished_by_stop
            else {"type": "length", "length": N},
            "prompt_tokens": P,
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "dp_rank": None,
        }
        if req.get("return_logprob"):
            start = int(req.get("logprob_start_len", -1))
            start = P - 1 if start < 0 else start
            tok_in = [[None if t == 0 else logprobs_in[t - 1, ids[t]].item(), ids[t], None] for t in range(start, P)]
            tok_out = [[logprobs_out[P - 1 + j, tokens[j]].item(), tokens[j], None] for j in range(N)]
            meta["input_token_logprobs"] = tok_in
            meta["output_token_logprobs"] = tok_out
            meta["output_token_logprobs_length"] = len(tok_out)
            k = int(req.get("top_logprobs_num") or 0)
            if k > 0:
                top_in = _top(logprobs_in[max(start - 1, 0) : P - 1], k)
                meta["input_top_logprobs"] = ([None] if start == 0 else []) + top_in
                meta["output_top_logprobs"] = _top(logprobs_out[P - 1 : P - 1 + max(N, 1)], k)
        meta["completion_tokens"] = N
        meta["cached_tokens"] = 0
        meta["cached_tokens_details"] = None
        if req.get("return_hidden_states"):
            meta["hidden_states"] = ([_bf16_rows(rows[:P])] + _bf16_rows(rows[P:])) if N else []
        if spec is not None:
            steps, _, ndt = self.spec
            hist = [0] * max(spec.accept_lengths, default=1)
            for a in spec.accept_lengths:
                hist[a - 1] += 1
            correct = sum(a - 1 for a in spec.accept_lengths)
            proposed = spec.verify_count * (ndt - 1)
            meta.update(
                spec_verify_ct=spec.verify_count,
                spec_accept_length=N / spec.verify_count if spec.verify_count else 0,
                spec_accept_rate=correct / proposed if proposed else 0.0,
                spec_num_correct_drafts=correct,
                spec_num_proposed_drafts=proposed,
                spec_accept_histogram=hist,
                spec_accepted_drafts=correct,
                spec_proposed_drafts=proposed,
                spec_correct_drafts_histogram=list(hist),
            )
        meta["e2e_latency"] = time.time() - t0
        meta["response_sent_to_client_ts"] = time.time()
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        timeline: list[tuple[float, int]] = [(0.0, 1)] if N else []
        if spec is not None:
            left = N - 1
            for n, cycle in zip(spec.accept_lengths, timings.cycle_s):
                if left <= 0:
                    break
                timeline.append((cycle, min(n, left)))
                left -= n
        elif N > 1:
            timeline += [(timings.decode_s / (N - 1), 1)] * (N - 1)
        return {"text": text, "output_ids": tokens, "meta_info": meta}, timeline


class BadRequest(ValueError):
    pass
