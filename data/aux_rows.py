"""Are a harvest's aux hidden-state rows at their tokens? A check that needs no second copy of the target.

The argmax check (checks.py) catches per-token rows shifted together, at T=0 only. Hidden-state rows shifted alone,
their count kept and the top-k rows in place, pass it and every shape check, and a drafter trained on them learns from
the wrong token's features. The logit lens of the deepest aux layer tells them apart: norm(h_t) · W (the target's
final norm and lm_head) ranks the target's own top-1 of row t above the neighbours' top-1s, of rows t-1 and t+1, on
most rows; rows moved by one hand the win to that neighbour instead (SmolLM2-135M, layer 26 of 30, 10,320 rows of 48
ShareGPT conversations: 75% at the row itself as stored, 73-78% at the neighbour when moved by one).
Only the three candidates' head rows are read per row, so the check costs 3·H multiply-adds a row.

A chunk is refused only when a neighbour wins more than half of the rows counted so far and at least twice as many as
the row itself: a target whose lens says little (~a third each) passes, a shift by one does not. Rows moved by two or
more also give about a third each, so they pass: the check is for the off-by-one. At any temperature.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

MAX_ROWS = 256  # rows looked at per sample, evenly spaced
MIN_ROWS = 64  # rows counted before a refusal


@dataclass(frozen=True)
class Lens:
    """The target's final norm (H,), its eps, and its lm_head (V, H)."""

    norm: torch.Tensor
    eps: float
    head: torch.Tensor

    def scores(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """norm(h) · head[ids]: h (N, H), ids (N, C) -> (N, C) float32."""
        h = h.float()
        hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm.float()
        return torch.einsum("nh,nch->nc", hn, self.head[ids].float())


def lens_of_model(model) -> Lens:
    """The Lens of a transformers causal LM (Llama, DeepSeek-V3: `model.model.norm`, the output embedding)."""
    norm = model.model.norm
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or model.config.rms_norm_eps
    return Lens(norm.weight.detach().cpu(), float(eps), model.get_output_embeddings().weight.detach().cpu())


def row_offsets(aux_deep: torch.Tensor, top1: torch.Tensor, lens: Lens, max_rows: int = MAX_ROWS) -> Counter:
    """Which row's top-1 the lens of each row ranks first, among rows t-1, t, t+1: Counter(before, here, after).

    aux_deep (T, H) the deepest aux layer's rows, top1 (T,) the target's top-1 per row (the distribution over token
    t+1). Rows whose three candidates are not distinct are not counted."""
    T = aux_deep.shape[0]
    if T < 3:
        return Counter()
    rows = torch.arange(1, T - 1)
    if rows.numel() > max_rows:
        rows = rows[torch.linspace(0, rows.numel() - 1, max_rows).long()]
    top1 = top1.long()
    cand = torch.stack([top1[rows - 1], top1[rows], top1[rows + 1]], dim=1)  # (N, 3)
    distinct = (cand[:, 0] != cand[:, 1]) & (cand[:, 1] != cand[:, 2]) & (cand[:, 0] != cand[:, 2])
    if not distinct.any():
        return Counter()
    won = lens.scores(aux_deep[rows[distinct]], cand[distinct]).argmax(-1).bincount(minlength=3).tolist()
    return Counter(before=won[0], here=won[1], after=won[2])


def shifted(total: Counter) -> str | None:
    """'before' or 'after' when that neighbour's wins say the rows are moved by one; None otherwise."""
    n = total["before"] + total["here"] + total["after"]
    if n < MIN_ROWS:
        return None
    side = max(("before", "after"), key=lambda k: total[k])
    return side if total[side] > n / 2 and total[side] >= 2 * total["here"] else None


def lens_of_target(target_cfg) -> Lens:
    """The Lens read from the target's safetensors alone (the SGLang backend has no model in this process, and the
    model is never loaded for it); a `tiny` target is built."""
    from eagle3ft.targets.hf import load_final_norm, load_output_head

    files_only = target_cfg.kind != "tiny"
    norm, eps = load_final_norm(target_cfg, files_only)
    return Lens(norm, eps, load_output_head(target_cfg, files_only))


def row_checker(mode: str, target, target_cfg, aux_layer_ids, hidden_size: int):
    """(sample -> Counter, or None; what the summary says): the check of harvest.aux_row_check `mode` for `target`."""
    if mode == "skip" or not aux_layer_ids:
        return None, "off"
    model = getattr(target, "model", None)  # the embedded backend's transformers model
    try:
        lens = lens_of_model(model) if model is not None else lens_of_target(target_cfg)
    except Exception as e:  # a config-only folder (SGLang's dummy weights), no lm_head in the files, ...
        if mode == "require":
            raise ValueError(
                f"harvest.aux_row_check is require but the target's final norm and lm_head cannot be read from "
                f"target.path {target_cfg.path!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None
        return None, f"off (the target's final norm and lm_head could not be read: {type(e).__name__})"
    j = max(range(len(aux_layer_ids)), key=lambda i: aux_layer_ids[i])  # the deepest aux layer's chunk
    cols = slice(j * hidden_size, (j + 1) * hidden_size)
    return (lambda s: row_offsets(s.aux_hidden[:, cols], s.topk_ids[:, 0], lens)), f"layer {aux_layer_ids[j]}"
