"""The DFlash block objective, as SpecForge's OnlineDFlashModel trains what SGLang 0.5.17 serves (the paper's Eq. 4).

Per sequence, anchors are drawn uniformly without replacement among the positions p whose token and next token are
both supervised (loss_mask[p] and loss_mask[p + 1]), up to `num_anchors`, sorted, fresh every step; blocks may
overlap. Block n is [x_a, MASK x (B-1)] at RoPE positions a..a+B-1 and sees the target features j < a (strictly: the
anchor's own feature does not exist yet when SGLang drafts it) and its own block only (dflash_model.block_mask).
Block position k >= 1 predicts the token at its own position, x[a + k], through the frozen target LM head over the
full target vocabulary; its weight is exp(-(k - 1) / gamma) x loss_mask[a + k] x (a + k inside the sequence), and the
loss is the weighted cross-entropy over the weight sum. Pure functions, no distributed code.

Shapes: B batch, T tokens, nb anchors per row, Bk block size, K·h features, V target vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from eagle3ft.drafter.dflash_model import DFlashDrafter, noise_ids


@dataclass
class DFlashLoss:
    loss: torch.Tensor  # () the weighted mean cross-entropy (0 when nothing is supervised)
    weight_sum: torch.Tensor  # () sum of the position weights (for averaging over ranks or micro-batches)
    correct: torch.Tensor  # (Bk - 1,) argmax hits at block positions 1..Bk-1, over positions with weight > 0
    count: torch.Tensor  # (Bk - 1,) positions with weight > 0 at each block position
    # (Bk - 1,) the chain: blocks whose drafts at 1..k-1 all hit and whose position k is supervised (chain_valid),
    # and of those the ones that hit at k too (chain_correct); their ratio is the conditional acceptance at k
    chain_correct: torch.Tensor | None = None
    chain_valid: torch.Tensor | None = None

    @property
    def acc(self) -> torch.Tensor:
        """Per-position accuracy (Bk - 1,): not conditional on earlier positions, so not τ."""
        return self.correct / self.count.clamp(min=1)


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: p with loss_mask[p] and loss_mask[p + 1] (the anchor in an answer, its first label supervised)."""
    m = loss_mask.bool()
    out = torch.zeros_like(m)
    out[:, :-1] = m[:, :-1] & m[:, 1:]
    return out


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, nb) anchors per row, sorted, uniformly without replacement among anchor_candidates, at most num_anchors;
    nb = the largest count in the batch, shorter rows padded with -1 at the end."""
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be positive, got {num_anchors}")
    cand = anchor_candidates(loss_mask)
    rows = []
    for b in range(cand.shape[0]):
        pos = cand[b].nonzero()[:, 0]
        pick = torch.randperm(len(pos), generator=generator, device="cpu")[:num_anchors].to(pos.device)
        rows.append(pos[pick].sort().values)
    nb = max((len(r) for r in rows), default=0)
    anchors = torch.full((cand.shape[0], nb), -1, dtype=torch.long, device=loss_mask.device)
    for b, r in enumerate(rows):
        anchors[b, : len(r)] = r
    return anchors


def position_weights(
    anchors: torch.Tensor, loss_mask: torch.Tensor, block_size: int, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, label positions), each (B, nb, Bk): exp(-(k - 1)/gamma) for k >= 1, 0 for k = 0, x loss_mask at the
    label position a + k, x in-bounds, x a real (non-padding) anchor. Positions are clamped into the sequence."""
    T = loss_mask.shape[1]
    k = torch.arange(block_size, device=anchors.device)
    pos = anchors[..., None] + k  # (B, nb, Bk)
    decay = torch.exp(-(k - 1).clamp(min=0).double() / gamma).float()
    decay[0] = 0.0
    inside = (pos < T) & (anchors[..., None] >= 0)
    pos = pos.clamp(0, T - 1)
    lm = loss_mask.float().gather(1, pos.flatten(1)).view(pos.shape)
    return decay * lm * inside, pos


def dflash_loss(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    anchors: torch.Tensor,
    gamma: float = 7.0,
    ce_chunk: int | None = None,
) -> DFlashLoss:
    """features (B, T, K·h) the target's layer outputs at every position (no shift); tokens, loss_mask (B, T);
    embed, lm_head (V, h) the target's, frozen; anchors (B, nb) from sample_anchors -> DFlashLoss. ce_chunk: the
    cross-entropy over that many positions at a time, each chunk's (positions x V) logits recomputed in the backward
    pass instead of kept (None: all at once)."""
    cfg = drafter.config
    if cfg.mask_token_id is None:
        raise ValueError(f"{cfg.path}: training needs dflash_config.mask_token_id")
    Bk = cfg.block_size
    B, nb = anchors.shape
    noise = F.embedding(noise_ids(tokens, anchors, Bk, cfg.mask_token_id), embed.detach())  # (B, nb·Bk, h)
    hidden = drafter(features.to(noise.dtype), noise, anchors).view(B, nb, Bk, cfg.hidden_size)  # (B, nb, Bk, h)
    weight, pos = position_weights(anchors, loss_mask, Bk, gamma)  # (B, nb, Bk)
    labels = tokens.gather(1, pos.flatten(1)).view(pos.shape)  # same position: block k predicts x[a + k]
    kept = weight > 0
    hk, yk, w = hidden[kept], labels[kept], weight[kept]  # (P, h), (P,), (P,): only the supervised positions
    head = lm_head.detach()
    step = ce_chunk or max(len(w), 1)
    parts = []  # (weighted CE sum, hits) per chunk of positions; a chunk's logits are recomputed in the backward
    for lo in range(0, len(w), step):
        args = (hk[lo : lo + step], head, yk[lo : lo + step], w[lo : lo + step])
        recompute = ce_chunk is not None and torch.is_grad_enabled() and hk.requires_grad
        parts.append(checkpoint(_chunk_ce, *args, use_reentrant=False) if recompute else _chunk_ce(*args))
    weight_sum = w.float().sum()
    if len(w):
        loss = sum(p[0] for p in parts) / weight_sum
    else:  # nothing supervised in this batch: a zero loss that still gives every parameter a (zero) gradient
        loss = sum(p.sum() for p in drafter.parameters()) * 0.0
    k_of = torch.arange(Bk, device=anchors.device).expand(B, nb, Bk)[kept] - 1  # (P,) 0..Bk-2
    hits = torch.cat([p[1] for p in parts]) if parts else w.new_zeros(0, dtype=torch.float)
    correct = torch.zeros(Bk - 1, device=hits.device).index_add_(0, k_of, hits)
    count = torch.zeros(Bk - 1, device=hits.device).index_add_(0, k_of, torch.ones_like(hits))
    hit_all = torch.zeros(B, nb, Bk, device=hits.device)
    hit_all[kept] = hits
    hit_all, kept_f = hit_all[..., 1:], kept[..., 1:].float()  # (B, nb, Bk - 1)
    before = torch.cat([torch.ones_like(hit_all[..., :1]), hit_all[..., :-1].cumprod(-1)], -1)  # all earlier hit
    chain_valid = (before * kept_f).sum((0, 1))
    chain_correct = (before * kept_f * hit_all).sum((0, 1))
    return DFlashLoss(loss, weight_sum.detach(), correct.detach(), count, chain_correct.detach(), chain_valid)


def _chunk_ce(
    hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of weight x CE, argmax hits) of a chunk: hidden (n, h) through head (V, h), in float32 at least."""
    logits = hidden @ head.t()  # (n, V)
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (weight.to(ce.dtype) * ce).sum(), (logits.argmax(-1) == labels).float().detach()


def decay_weights(block_size: int, gamma: float = 7.0) -> list[float]:
    """The position weights before masking, k = 0..Bk-1: [0, 1, e^(-1/gamma), ...] (for logs and tests)."""
    return [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block_size)]
