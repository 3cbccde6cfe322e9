"""Embedded DFlash block speculative decoding, greedy or sampled: a transformers target and a DFlash drafter in one process, the
cycle SGLang 0.5.17's DFlashWorkerV2 runs (docs/dflash.md).

Batch 1. Prefill: the target's forward over the prompt gives the first token (the first bonus b) and the prompt's
features, which become the draft's context keys and values (DraftContext.append; no draft forward over the prompt).
One cycle at committed length L:
  draft   one drafter forward over [b, MASK x (B-1)] at positions L..L+B-1, attending to every committed token's
          context and to its own block; the target's LM head picks d_1..d_{B-1} (DraftContext.draft);
  verify  one causal target forward over the chain [b, d_1..d_{B-1}];
  accept  greedy: the longest prefix of drafts equal to the target's argmax; the target's token after it is the next
          bonus. Sampled (temperature > 0): SGLang's DFLASH target-only chain verify (verify_target_only), the draft
          a point mass: d_i kept with the target's probability of it at the temperature, else the bonus is drawn
          from the target's distribution with d_i's mass removed; all kept -> the bonus from the last row;
  commit  crop the target's cache to L + accept + 1 and append the features of the committed rows (b, d_1..d_acc) to
          the draft context.
Greedy output equals plain greedy decoding exactly; sampled output (accept thresholds 1, SGLang's defaults) is
distributed as the target's sampling at the temperature. Per request it records the verify count and the tokens emitted per
verify (bonus included), as SGLang's spec_accept_length and "accept len" count them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from eagle3ft.drafter.dflash_model import DFlashDrafter, DraftContext
from eagle3ft.eval.decode.speculate import Generation, _choose, _finish, crop_target, verify_greedy


def verify_target_only(
    p: torch.Tensor,
    drafts: torch.Tensor,
    generator: torch.Generator | None = None,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> tuple[int, int]:
    """SGLang 0.5.17's sampled DFLASH verify (speculative/dflash_utils.py compute_dflash_sampling_correct_drafts_and_bonus:
    sgl_kernel's tree_speculative_sampling_target_only over a chain with draft probabilities 0). p (B, V) the target's
    probabilities at the chain's rows (after the bonus, d_1..d_{B-1}), drafts (B-1,) -> (accepted drafts, next token).

    Per level a fresh coin u: d_i is kept when u <= p_i(d_i) / threshold_acc or p_i(d_i) >= threshold_single. On the
    first rejection the next token is drawn from relu(p_i - p_i(d_i) at d_i), p_i without d_i, renormalised; all kept:
    from the last row. At thresholds 1 this is rejection sampling against a point-mass draft, exact in distribution."""
    acc = max(float(threshold_acc), 1e-9)
    for i, d in enumerate(int(x) for x in drafts):
        u = torch.rand((), generator=generator, dtype=torch.float64, device=p.device)
        single = p[i, d]
        if u <= single / acc or single >= threshold_single:
            continue
        residual = p[i].clone()
        residual[d] = 0
        return i, int(torch.multinomial(residual, 1, generator=generator))
    last = drafts.shape[0]
    return last, int(torch.multinomial(p[last], 1, generator=generator))


class DFlashDecoder:
    """Block speculation of `model` (a transformers causal LM) with `drafter`, greedy at temperature 0, else sampled with
    SGLang's accept thresholds; embed and lm_head (V, h) are the target's, in the drafter's dtype."""

    def __init__(
        self,
        model,
        drafter: DFlashDrafter,
        eos_ids=(),
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        threshold_single: float = 1.0,
        threshold_acc: float = 1.0,
    ):
        self.model, self.drafter, self.eos = model, drafter, set(eos_ids)
        self.temperature, self.generator = temperature, generator
        self.thresholds = (threshold_single, threshold_acc)
        self.device = model.device
        dtype = next(drafter.parameters()).dtype
        self.embed = model.get_input_embeddings().weight.detach().to(dtype)
        self.lm_head = model.get_output_embeddings().weight.detach().to(dtype)
        self.points = drafter.config.hidden_state_indices()  # feature j = hidden_states[j + 1]
        self.dtype = dtype

    def features(self, hidden_states) -> torch.Tensor:
        """(1, n, K·h) the drafter's features of a forward's rows, ascending layer order."""
        return torch.cat([hidden_states[p] for p in self.points], -1).to(self.dtype)

    def prefill(self, prompt_ids: list[int], cache: DynamicCache, ctx: DraftContext) -> int:
        ids = torch.tensor([prompt_ids], device=self.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        ctx.append(self.features(out.hidden_states))
        return _choose(out.logits[0, -1], self.temperature, self.generator)

    def draft(self, bonus: int, ctx: DraftContext) -> torch.Tensor:
        """The one drafter forward of a cycle -> drafts (B - 1,)."""
        return ctx.draft(torch.tensor([bonus], device=self.device), self.embed, self.lm_head)[0]

    def verify(self, chain: torch.Tensor, cache: DynamicCache):
        """The target's causal forward over the chain (1, B), its hidden states kept for the commit's features."""
        return self.model(input_ids=chain, past_key_values=cache, use_cache=True, output_hidden_states=True)

    def cycle(self, bonus: int, cache: DynamicCache, ctx: DraftContext) -> tuple[list[int], int]:
        """One draft-verify-commit cycle -> (accepted drafts, the next bonus)."""
        drafts = self.draft(bonus, ctx)  # (B - 1,)
        chain = torch.cat([torch.tensor([bonus], device=self.device), drafts])[None]  # (1, B)
        L = cache.get_seq_length()
        out = self.verify(chain, cache)
        if self.temperature <= 0:
            accepted, nxt = verify_greedy(out.logits[0], drafts)
        else:
            p = F.softmax(out.logits[0].double() / self.temperature, dim=-1)  # (B, V)
            accepted, nxt = verify_target_only(p, drafts, self.generator, *self.thresholds)
        crop_target(cache, L + accepted + 1)
        ctx.append(self.features(out.hidden_states)[:, : accepted + 1])
        return drafts[:accepted].tolist(), nxt

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> Generation:
        cache, ctx = DynamicCache(), DraftContext(self.drafter)
        first = self.prefill(prompt_ids, cache, ctx)
        tokens, done = _finish([first], max_new_tokens, self.eos)
        g = Generation(tokens=tokens, prompt_tokens=len(prompt_ids))
        bonus = first
        while not done:
            accepted, bonus = self.cycle(bonus, cache, ctx)
            before = len(tokens)
            tokens, done = _finish(tokens + accepted + [bonus], max_new_tokens, self.eos)
            g.verify_count += 1
            g.accept_lengths.append(len(tokens) - before)
        g.tokens = tokens
        return g
