"""Embedded DFlash block speculative decoding (greedy): a transformers target and a DFlash drafter in one process, the
cycle SGLang 0.5.17's DFlashWorkerV2 runs (docs/dflash.md).

Batch 1. Prefill: the target's forward over the prompt gives the first token (the first bonus b) and the prompt's
features, which become the draft's context keys and values (DraftContext.append; no draft forward over the prompt).
One cycle at committed length L:
  draft   one drafter forward over [b, MASK x (B-1)] at positions L..L+B-1, attending to every committed token's
          context and to its own block; the target's LM head picks d_1..d_{B-1} (DraftContext.draft);
  verify  one causal target forward over the chain [b, d_1..d_{B-1}];
  accept  the longest prefix of drafts equal to the target's argmax; the target's token after it is the next bonus;
  commit  crop the target's cache to L + accept + 1 and append the features of the committed rows (b, d_1..d_acc) to
          the draft context.
Greedy output equals plain greedy decoding exactly. Per request it records the verify count and the tokens emitted per
verify (bonus included), as SGLang's spec_accept_length and "accept len" count them.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from eagle3ft.drafter.dflash_model import DFlashDrafter, DraftContext
from eagle3ft.eval.decode.speculate import Generation, _finish, crop_target, verify_greedy


class DFlashDecoder:
    """Greedy block speculation of `model` (a transformers causal LM) with `drafter`; embed and lm_head (V, h) are the
    target's, in the drafter's dtype."""

    def __init__(self, model, drafter: DFlashDrafter, eos_ids=()):
        self.model, self.drafter, self.eos = model, drafter, set(eos_ids)
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
        return int(out.logits[0, -1].argmax(-1))

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
        accepted, nxt = verify_greedy(out.logits[0], drafts)
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
