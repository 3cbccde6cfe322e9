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
Position convention (as eval/offline/accept_len.py): the drafter entry holding the embedding of token j+1
is at position j.

Per request it records the verify count and the tokens emitted per verify (bonus included, as SGLang's
spec_accept_length). The algorithm alone, as gpt-fast's generate.py: it times nothing. Its phases are
methods (prefill, draft_step or draft_chain, verify, extend, cycle) so that a caller can time around them
(eval/bench/embedded_backend.py does). With drafting="graph" (greedy only) the drafts after the extend come from
eval/decode/draft_graph.py: the same chain with no host round trip, one CUDA graph replay per cycle on a GPU (with
graph_extend, the extend after each verify too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from eagle3ft.drafter.config import capture_points
from eagle3ft.drafter.model import DraftCache, Eagle3Drafter
from eagle3ft.eval.decode.draft_graph import DraftGraph


@dataclass
class Generation:
    """One request's output."""

    tokens: list[int]
    prompt_tokens: int
    verify_count: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per verify, bonus included

    @property
    def tau(self) -> float | None:
        return sum(self.accept_lengths) / self.verify_count if self.verify_count else None


def aux_from_hidden_states(hidden_states, aux_layer_ids, target_config) -> torch.Tensor:
    """(B, T, 3Ht): the aux rows as SGLang takes them on this target (capture_points: hidden_states[i + 1] for a
    Llama, the state entering layer i for a DeepSeek-V3 whose first id is not 1)."""
    points = capture_points(getattr(target_config, "architectures", None), aux_layer_ids)
    return torch.cat([hidden_states[p] for p in points], dim=-1)


def crop_target(cache: DynamicCache, n: int) -> None:
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


class PlainDecoder:
    """Plain decoding with a KV cache, one target forward per token: the baseline."""

    def __init__(self, model, eos_ids=(), temperature: float = 0.0, generator: torch.Generator | None = None):
        self.model = model
        self.eos = set(eos_ids)
        self.temperature, self.generator = temperature, generator
        self.device = model.device

    def prefill(self, prompt_ids: list[int], cache: DynamicCache) -> int:
        """The prompt's forward; returns the first new token."""
        ids = torch.tensor([prompt_ids], device=self.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return _choose(out.logits[0, -1], self.temperature, self.generator)

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        cache = DynamicCache()
        tokens, done = _finish([self.prefill(prompt_ids, cache)], max_new_tokens, self.eos)
        while not done:
            ids = torch.tensor([[tokens[-1]]], device=self.device)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
            nxt = _choose(out.logits[0, -1], self.temperature, self.generator)
            tokens, done = _finish(tokens + [nxt], max_new_tokens, self.eos)
        return Generation(tokens=tokens, prompt_tokens=len(prompt_ids))


def greedy_decode(
    model, prompt_ids: list[int], max_new_tokens: int, eos_ids=(), temperature: float = 0.0, generator=None
) -> Generation:
    """Plain decoding of one prompt (PlainDecoder)."""
    return PlainDecoder(model, eos_ids, temperature, generator).generate(prompt_ids, max_new_tokens)


def verify_greedy(target_logits: torch.Tensor, drafts) -> tuple[int, int]:
    """target_logits (K+1, V) over tokens after root, d1..dK; drafts K ids -> (accepted drafts, next token).
    The target's choices come to the host in one copy."""
    best, drafts = target_logits.argmax(-1).tolist(), [int(d) for d in drafts]
    m = 0
    while m < len(drafts) and drafts[m] == best[m]:
        m += 1
    return m, best[m]


def verify_sampled(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
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


@dataclass
class DecodeState:
    """What one cycle hands the next: both caches, the tokens so far (the root, the last emitted token,
    is token length - 1), and the drafter's last pre-norm output h and logits (the first draft's inputs)."""

    tcache: DynamicCache
    dcache: DraftCache
    root: int
    length: int
    h: torch.Tensor  # (1, 1, H)
    logits: torch.Tensor  # (draft_vocab,)


class SpeculativeDecoder:
    """Target (transformers causal LM) + Eagle3Drafter, chain drafting of `steps` tokens per cycle. drafting:
    "eager" (a drafter forward at a time) or "graph" (greedy: eval/decode/draft_graph.py, captured as a CUDA graph on a GPU;
    graph_extend: the extend after each verify too)."""

    def __init__(
        self,
        target,
        drafter: Eagle3Drafter,
        aux_layer_ids,
        steps: int,
        temperature: float = 0.0,
        eos_ids=(),
        generator: torch.Generator | None = None,
        drafting: str = "eager",
        graph_extend: bool = False,
    ):
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if drafting not in ("eager", "graph"):
            raise ValueError(f"drafting {drafting!r}: expected eager or graph")
        if drafting == "graph" and temperature > 0:
            raise ValueError("the graphed draft chain is greedy: drafting graph needs temperature 0")
        self.target, self.drafter = target, drafter
        self.aux_layer_ids = list(aux_layer_ids)
        self.steps, self.temperature = steps, temperature
        self.eos = set(eos_ids)
        self.generator = generator
        self.device = target.device
        self.dtype = next(drafter.parameters()).dtype
        self.vocab = drafter.config.vocab_size
        self.drafting, self.graph_extend = drafting, graph_extend and drafting == "graph"
        self.graph: DraftGraph | None = None  # drafting="graph": built for the longest request so far

    def _graph_for(self, rows: int) -> DraftGraph:
        """A DraftGraph whose cache holds `rows`, captured again (at the next power of two, >= 1024) when it does not."""
        if self.graph is None or self.graph.capacity < rows:
            capacity = max(1024, 1 << (rows - 1).bit_length())
            self.graph = DraftGraph(self.drafter, self.steps, capacity, self.device, extend=self.graph_extend)
        return self.graph

    def _target(self, ids: list[int] | torch.Tensor, cache: DynamicCache):
        ids = torch.as_tensor(ids, device=self.device).view(1, -1)
        out = self.target(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        aux = aux_from_hidden_states(out.hidden_states, self.aux_layer_ids, self.target.config)
        return out.logits[0], aux[0]  # (T, V), (T, 3Ht)

    def extend(self, cache: DraftCache, next_ids: list[int], aux: torch.Tensor, start: int):
        """Drafter forward over tokens whose aux features are known: entry j = aux of token j, embedding of j+1.
        graph_extend: a cycle's extend (at most steps + 1 tokens) is the DraftGraph's."""
        if self.graph_extend and self.graph is not None and len(next_ids) <= self.steps + 1:
            return self.graph.extend(next_ids, aux, start)
        ids = torch.tensor([next_ids], device=self.device)
        pos = torch.arange(start, start + len(next_ids), device=self.device)[None]
        h, lg = self.drafter.step(ids, self.drafter.fuse(aux.to(self.dtype)[None]), pos, cache)
        return h[:, -1:], lg[0, -1]

    def draft_step(self, d: int, h: torch.Tensor, position: int, cache: DraftCache):
        """Drafter forward on draft token d and the drafter's own previous output h."""
        ids, pos = torch.tensor([[d]], device=self.device), torch.tensor([[position]], device=self.device)
        h, lgs = self.drafter.step(ids, h, pos, cache)
        return h, lgs[0, -1]

    def verify(self, root: int, drafts: list[int], cache: DynamicCache):
        """One target forward over [root, d1..dK]: logits (K+1, V) and aux features (K+1, 3Ht)."""
        return self._target([root] + drafts, cache)

    def draft_chain(self, s: DecodeState) -> list[int]:
        """drafting="graph": the cycle's drafts from the extend's logits, in one go on the device."""
        return self.graph.run(s.logits, s.h, s.length - 1)

    def _pick_draft(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """(target id of the draft token, q over the target vocab or None when greedy)."""
        if self.temperature <= 0:
            return int(self.drafter.draft_to_target(logits.argmax(-1))), None
        q_draft = F.softmax(logits.double() / self.temperature, dim=-1)
        d = torch.multinomial(q_draft, 1, generator=self.generator)[0]
        q = torch.zeros(self.vocab, dtype=torch.float64, device=logits.device)
        q[self.drafter.draft_to_target(torch.arange(q_draft.shape[0], device=logits.device))] = q_draft
        return int(self.drafter.draft_to_target(d)), q

    def prefill(self, prompt_ids: list[int]) -> DecodeState:
        """The prompt's target forward, the first new token (the root), the drafter extended over the prompt."""
        tcache, dcache = DynamicCache(), DraftCache()
        if self.graph is not None:
            dcache = self.graph.cache
            dcache.crop(0)
        logits, aux = self._target(prompt_ids, tcache)
        root = _choose(logits[-1], self.temperature, self.generator)
        h, lg = self.extend(dcache, list(prompt_ids[1:]) + [root], aux, 0)
        return DecodeState(tcache, dcache, root, len(prompt_ids) + 1, h, lg)

    def draft(self, s: DecodeState) -> tuple[list[int], list[torch.Tensor | None]]:
        """The cycle's `steps` drafts (target ids) and, per draft, q over the target vocab (None when greedy)."""
        if self.graph is not None:
            return self.draft_chain(s), []
        drafts, qs = [], []
        h, lg = s.h, s.logits
        for k in range(self.steps):
            d, q = self._pick_draft(lg)
            drafts.append(d)
            qs.append(q)
            if k < self.steps - 1:
                h, lg = self.draft_step(d, h, s.length - 1 + k, s.dcache)
        return drafts, qs

    def cycle(self, s: DecodeState) -> list[int]:
        """Draft, verify, accept, extend; returns the tokens emitted (bonus included) and advances s."""
        drafts, qs = self.draft(s)
        vlogits, vaux = self.verify(s.root, drafts, s.tcache)
        if self.temperature <= 0:
            m, nxt = verify_greedy(vlogits, drafts)
        else:
            p = F.softmax(vlogits.double() / self.temperature, dim=-1)
            dt = torch.tensor(drafts, device=self.device)
            m, nxt = verify_sampled(p, torch.stack(qs), dt, self.generator)
        new = drafts[:m] + [nxt]
        crop_target(s.tcache, s.length + m)
        s.dcache.crop(s.length - 1)
        s.h, s.logits = self.extend(s.dcache, new, vaux[: m + 1], s.length - 1)
        s.length += len(new)
        s.root = nxt
        return new

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        if self.drafting == "graph":  # the drafter's rows: the prompt, the answer, a cycle's drafts beyond it
            self._graph_for(len(prompt_ids) + max_new_tokens + self.steps + 1)
        s = self.prefill(prompt_ids)
        g = Generation(tokens=[s.root], prompt_tokens=len(prompt_ids))
        g.tokens, done = _finish(g.tokens, max_new_tokens, self.eos)
        while not done:
            new = self.cycle(s)
            g.verify_count += 1
            g.accept_lengths.append(len(new))
            g.tokens, done = _finish(g.tokens + new, max_new_tokens, self.eos)
        return g
