"""Offline accept length on the benchmark's own prompts and answers: offline and live tau on the same tokens.

The bench's plain greedy pass gives the target's own answer to each prompt. One target forward over
prompt + answer gives what a harvest would store for it (the aux layers' hidden states, the top-k
log-probs of the next token), and eval/accept_len.py's chain evaluation on those features is the
offline tau of exactly the tokens the live runs decoded. What still differs: the live tau starts a
cycle only where the previous one ended, while the offline one averages over every answer token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3ft.eval.accept_len import evaluate
from eagle3ft.eval.costs import Setting
from eagle3ft.eval.speculate import aux_from_hidden_states


@torch.no_grad()
def features(model, aux_layer_ids: list[int], prompt: list[int], answer: list[int], topk: int = 16) -> dict:
    """A store-like item: input_ids (T,), loss_mask (T,) 1 on the answer, aux_hidden (T, 3H), topk ids/log-probs (T,
    topk)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + answer], device=device)  # (1, T)
    out = model(input_ids=ids, output_hidden_states=True)
    lp = F.log_softmax(out.logits[0].float(), dim=-1).topk(topk, dim=-1)  # (T, topk)
    mask = torch.zeros(ids.shape[1], dtype=torch.long, device=device)
    mask[len(prompt) :] = 1
    aux = aux_from_hidden_states(out.hidden_states, aux_layer_ids)[0]  # (T, 3H)
    return {
        "input_ids": ids[0],
        "loss_mask": mask,
        "aux_hidden": aux,
        "topk_ids": lp.indices,
        "topk_logprobs": lp.values,
    }


def offline_tau(
    model,
    drafter,
    aux_layer_ids: list[int],
    prompts: list[list[int]],
    answers: list[list[int]],
    settings: list[Setting],
) -> dict | None:
    """Chain-greedy offline tau per chain setting (d/1/d+1 up to the deepest benchmarked) on these prompts and
    answers."""
    depth = max((s.steps for s in settings if s.topk == 1), default=0)
    if depth == 0:
        return None
    device = next(model.parameters()).device
    items = (features(model, aux_layer_ids, p, a) for p, a in zip(prompts, answers) if len(a) > 1)
    rep = evaluate(drafter, items, depth, 1, depth + 1, 0.0, device)
    return {
        "source": "the plain pass's greedy answers to the bench prompts",
        "samples": rep.samples,
        "roots": rep.roots,
        "settings": {k: v["tau"] for k, v in rep.settings.items()},
    }
