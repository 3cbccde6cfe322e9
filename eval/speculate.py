"""Embedded EAGLE-3 speculative decoding: a transformers target and the drafter in one process.

Batch 1, chain drafting (SGLang's --speculative-eagle-topk 1). One cycle:
  draft   `steps` tokens: the first from the logits of the previous extend, each later one from a
          drafter forward on the previous draft token and the drafter's own pre-norm output;
  verify  one target forward over [root, d1..d_steps] (root = the last emitted token);
  accept  greedy: the longest prefix of drafts equal to the target's argmax, plus the target's
          next token (the bonus); sampled: the standard rejection rule, draft d_j kept with
          probability min(1, p(d_j)/q(d_j)), else a token from max(0, p - q) renormalised and stop;
          all kept -> a bonus token from p. Greedy output equals plain greedy decoding exactly;
          sampled output is distributed as the target's sampling at the temperature;
  extend  crop both caches to the accepted tokens, then feed the drafter the accepted tokens'
          aux hidden states from the verify forward (aux id i == hidden_states[i + 1]).
Position convention (as eval/accept_len.py): the drafter entry holding the embedding of token j+1
is at position j.

Per request it records the verify count, tokens emitted per verify (bonus included, as SGLang's
spec_accept_length), seconds per verify forward, per drafter forward and per whole cycle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from eagle3ft.train.model import DraftCache, Eagle3Drafter


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Generation:
    """One request's output and timings (seconds)."""

    tokens: list[int]
    prompt_tokens: int
    prefill_s: float
    decode_s: float  # after the first new token until the last
    verify_count: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify, bonus included
    verify_s: list[float] = field(default_factory=list)  # target forward per verify
    draft_forward_s: list[float] = field(default_factory=list)  # each drafter forward (extends and draft steps)
    cycle_s: list[float] = field(default_factory=list)  # draft + verify + accept + extend

    @property
    def tau(self) -> float | None:
        return sum(self.accept_lengths) / self.verify_count if self.verify_count else None


def aux_from_hidden_states(hidden_states, aux_layer_ids) -> torch.Tensor:
    """(B, T, 3Ht): the outputs of the aux layers; layer id i is transformers' hidden_states[i + 1]."""
    return torch.cat([hidden_states[i + 1] for i in aux_layer_ids], dim=-1)


def _crop_target(cache: DynamicCache, n: int) -> None:
    """Keep the first n positions (a negative crop: the form every transformers 5.x accepts)."""
    drop = cache.get_seq_length() - n
    if drop > 0:
        cache.crop(-drop)


def _finish(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> tuple[list[int], bool]:
    """Cut at the first end-of-sequence token (kept) and at max_new_tokens; True when done."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: min(i + 1, max_new_tokens)], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax(-1))
    p = F.softmax(logits.double() / temperature, dim=-1)
    return int(torch.multinomial(p, 1, generator=generator))


@torch.no_grad()
def greedy_decode(model, prompt_ids: list[int], max_new_tokens: int, eos_ids=(), temperature: float = 0.0, generator=None) -> Generation:
    """Plain decoding with a KV cache, one target forward per token: the baseline."""
    dev = model.device
    eos = set(eos_ids)
    cache = DynamicCache()
    _sync(dev)
    t0 = time.perf_counter()
    out = model(input_ids=torch.tensor([prompt_ids], device=dev), past_key_values=cache, use_cache=True)
    tokens = [_choose(out.logits[0, -1], temperature, generator)]
    _sync(dev)
    t1 = time.perf_counter()
    tokens, done = _finish(tokens, max_new_tokens, eos)
    while not done:
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=dev), past_key_values=cache, use_cache=True)
        tokens, done = _finish(tokens + [_choose(out.logits[0, -1], temperature, generator)], max_new_tokens, eos)
    _sync(dev)
    return Generation(tokens=tokens, prompt_tokens=len(prompt_ids), prefill_s=t1 - t0, decode_s=time.perf_counter() - t1)


def verify_greedy(target_logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """target_logits (K+1, V) over tokens after root, d1..dK; drafts (K,) -> (accepted drafts, next token)."""
    best = target_logits.argmax(-1)
    m = 0
    while m < drafts.shape[0] and int(drafts[m]) == int(best[m]):
        m += 1
    return m, int(best[m])


def verify_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling. p (K+1, V) target probabilities, q (K, V) draft probabilities in the
    target vocabulary, drafts (K,) sampled from q -> (accepted drafts, next token)."""
    K = drafts.shape[0]
    for j in range(K):
        x = int(drafts[j])
        u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device)
        if u * q[j, x] < p[j, x]:  # u < min(1, p/q) without dividing
            continue
        residual = (p[j] - q[j]).clamp(min=0)
        total = residual.sum()
        dist = residual / total if total > 0 else p[j]
        return j, int(torch.multinomial(dist, 1, generator=generator))
    return K, int(torch.multinomial(p[K], 1, generator=generator))


class SpeculativeDecoder:
    """Target (transformers causal LM) + Eagle3Drafter, chain drafting of `steps` tokens per cycle."""

    def __init__(self, target, drafter: Eagle3Drafter, aux_layer_ids, steps: int, temperature: float = 0.0, eos_ids=(), generator: torch.Generator | None = None):
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.target, self.drafter = target, drafter
        self.aux_layer_ids = list(aux_layer_ids)
        self.steps, self.temperature = steps, temperature
        self.eos = set(eos_ids)
        self.generator = generator
        self.device = target.device
        self.dtype = next(drafter.parameters()).dtype
        self.vocab = drafter.config.vocab_size

    def _target(self, ids: list[int] | torch.Tensor, cache: DynamicCache):
        ids = torch.as_tensor(ids, device=self.device).view(1, -1)
        out = self.target(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        return out.logits[0], aux_from_hidden_states(out.hidden_states, self.aux_layer_ids)[0]  # (T, V), (T, 3Ht)

    def _extend(self, cache: DraftCache, next_ids: list[int], aux: torch.Tensor, start: int, times: list[float]):
        """Drafter forward over tokens whose aux features are known: entry j = aux of token j, embedding of j+1."""
        _sync(self.device)
        t = time.perf_counter()
        ids = torch.tensor([next_ids], device=self.device)
        pos = torch.arange(start, start + len(next_ids), device=self.device)[None]
        h, lg = self.drafter.step(ids, self.drafter.fuse(aux.to(self.dtype)[None]), pos, cache)
        _sync(self.device)
        times.append(time.perf_counter() - t)
        return h[:, -1:], lg[0, -1]

    def _pick_draft(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """(target id of the draft token, q over the target vocab or None when greedy)."""
        if self.temperature <= 0:
            return int(self.drafter.draft_to_target(logits.argmax(-1))), None
        q_draft = F.softmax(logits.double() / self.temperature, dim=-1)
        d = torch.multinomial(q_draft, 1, generator=self.generator)[0]
        q = torch.zeros(self.vocab, dtype=torch.float64, device=logits.device)
        q[self.drafter.draft_to_target(torch.arange(q_draft.shape[0], device=logits.device))] = q_draft
        return int(self.drafter.draft_to_target(d)), q

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        tcache, dcache = DynamicCache(), DraftCache()
        _sync(self.device)
        t0 = time.perf_counter()
        logits, aux = self._target(prompt_ids, tcache)
        root = _choose(logits[-1], self.temperature, self.generator)
        P = len(prompt_ids)
        g = Generation(tokens=[root], prompt_tokens=P, prefill_s=0.0, decode_s=0.0)
        h, lg = self._extend(dcache, list(prompt_ids[1:]) + [root], aux, 0, g.draft_forward_s)
        _sync(self.device)
        t1 = time.perf_counter()
        g.prefill_s = t1 - t0
        L = P + 1  # tokens so far; the root is token L-1
        g.tokens, done = _finish(g.tokens, max_new_tokens, self.eos)
        while not done:
            c0 = time.perf_counter()
            drafts, qs = [], []
            for k in range(self.steps):
                d, q = self._pick_draft(lg)
                drafts.append(d)
                qs.append(q)
                if k < self.steps - 1:
                    t = time.perf_counter()
                    h, lgs = self.drafter.step(torch.tensor([[d]], device=self.device), h, torch.tensor([[L - 1 + k]], device=self.device), dcache)
                    lg = lgs[0, -1]
                    _sync(self.device)
                    g.draft_forward_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            vlogits, vaux = self._target([root] + drafts, tcache)
            _sync(self.device)
            g.verify_s.append(time.perf_counter() - t)
            dt = torch.tensor(drafts, device=self.device)
            if self.temperature <= 0:
                m, nxt = verify_greedy(vlogits, dt)
            else:
                p = F.softmax(vlogits.double() / self.temperature, dim=-1)
                m, nxt = verify_sampled(p, torch.stack(qs), dt, self.generator)
            new = drafts[:m] + [nxt]
            g.verify_count += 1
            g.accept_lengths.append(len(new))
            _crop_target(tcache, L + m)
            dcache.crop(L - 1)
            h, lg = self._extend(dcache, new, vaux[: m + 1], L - 1, g.draft_forward_s)
            L += len(new)
            root = nxt
            g.tokens, done = _finish(g.tokens + new, max_new_tokens, self.eos)
            g.cycle_s.append(time.perf_counter() - c0)
        _sync(self.device)
        g.decode_s = time.perf_counter() - t1
        return g
