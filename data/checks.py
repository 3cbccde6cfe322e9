"""The harvest's consistency checks, each refusing a chunk before it is committed.

- `argmax_check` / `check_argmax_rate` (T=0): every generated token is the target's argmax in the returned top-k.
  Per-token rows shifted together fail it at almost every position.
- `check_aux_rows` (any temperature): the aux hidden-state rows sit at their own tokens (data/aux_rows.py), which
  hidden-state rows shifted alone, the top-k in place, do not.
"""

from __future__ import annotations

from collections import Counter

import torch

from eagle3ft.config import HarvestConfig
from eagle3ft.data.aux_rows import shifted


class HarvestRefused(RuntimeError):
    """The target's answers fail a consistency check (T=0: generated tokens that are not its argmax; aux rows that
    sit at a neighbouring token)."""


def argmax_check(
    completion: list[int], topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, start: int, tie_eps: float
) -> Counter:
    """At T=0 every generated token is the target's argmax where it was predicted: completion[j] sits at
    position start + j and row start + j - 1 holds the distribution over it. A token whose log-prob is within
    `tie_eps` of the top-1's passes as a near-tie. A server whose per-token rows are shifted by one (same count)
    fails at almost every position. Returns Counter(checked, mismatched, ties)."""
    n = len(completion)
    if n == 0:
        return Counter()
    ids = topk_ids[start - 1 : start - 1 + n].long()  # (N, K)
    lps = topk_logprobs[start - 1 : start - 1 + n].float()
    tok = torch.tensor(completion, dtype=torch.long)[:, None]
    lp_tok = (
        torch.where(ids == tok, lps, torch.full_like(lps, -float("inf"))).max(dim=1).values
    )  # -inf: not in the top-k
    top1 = ids[:, 0] == tok[:, 0]
    ok = top1 | (lps[:, 0] - lp_tok <= tie_eps)
    return Counter(checked=n, mismatched=int((~ok).sum()), ties=int((ok & ~top1).sum()))


def check_argmax_rate(manifest: dict, chunk: Counter, h: HarvestConfig, where: str) -> None:
    """Refuse (before the chunk is committed) when the generated tokens that are not the target's argmax, over the
    whole harvest so far, exceed harvest.argmax_max_mismatch."""
    total = Counter(manifest.get("chunk_counts", {}).get("argmax_check", {})) + chunk
    if total["checked"] and total["mismatched"] > h.argmax_max_mismatch * total["checked"]:
        raise HarvestRefused(
            f"harvest refused at {where}: {total['mismatched']} of {total['checked']} tokens generated at T=0 are not "
            "the target's "
            f"argmax in the returned top-k (near-ties within {h.argmax_tie_eps} pass; limit "
            f"harvest.argmax_max_mismatch={h.argmax_max_mismatch}): "
            "the server's per-token rows are shifted or from another computation; nothing of this chunk was written"
        )


def check_aux_rows(manifest: dict, chunk: Counter, where: str, layer: str) -> None:
    """Refuse (before the chunk is committed) when the aux rows counted so far sit at a neighbouring token."""
    total = Counter(manifest.get("chunk_counts", {}).get("aux_rows", {})) + chunk
    side = shifted(total)
    if side is not None:
        n = sum(total.values())
        raise HarvestRefused(
            f"harvest refused at {where}: the aux hidden-state rows look moved by one token: the logit lens of aux "
            f"{layer} ranks the top-1 of the row {side} first on {total[side]} of {n} rows and the row's own on "
            f"{total['here']} (data/aux_rows.py); the server's hidden-state rows are shifted against its tokens; "
            "nothing of this chunk was written"
        )
