"""The samples' order and layout per epoch: the seeded (weighted) order, loop weighting, packed bins and rows."""

from __future__ import annotations

import torch

from eagle3ft.data.loops import answer_loops


def epoch_order(n: int, seed: int, epoch: int, weights: list[float] | None = None) -> list[int]:
    """The seeded per-epoch sample order (the same on every rank).

    With per-sample `weights` (their sources' SourceConfig.weight), sample i is drawn floor(w_i) times, and once more
    with probability w_i - floor(w_i), from the seed and the epoch; the draws then in a seeded order. None: each
    sample once (the plain order)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    if weights is None:
        return torch.randperm(n, generator=g).tolist()
    w = torch.tensor(weights, dtype=torch.float64)  # (n,)
    copies = w.floor().long() + (torch.rand(n, generator=g, dtype=torch.float64) < w - w.floor()).long()
    draws = torch.repeat_interleave(torch.arange(n), copies)
    return draws[torch.randperm(len(draws), generator=g)].tolist()


class EpochOrder(torch.utils.data.Dataset):
    """The dataset in a given per-epoch order (epoch_order: the same on every rank)."""

    def __init__(self, ds, order: list[int]) -> None:
        self.ds = ds
        self.order = order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        return self.ds[self.order[i]]


class LoopWeighted(torch.utils.data.Dataset):
    """The samples with the loss weight of their answers' loop tokens set to `weight` (train.loop_weight).

    Loops are data/loops.py's, found in each answer (each run of loss_mask 1) apart, on the full sample before any
    max_len cut. weight 0 sets loss_mask 0 on the loop tokens; a weight in (0, 1) leaves loss_mask alone and adds
    `loss_weight` (T,) float32 (that weight on loop tokens, 1 on the other answer tokens, 0 outside the answers),
    which train/ttt.py turns into a weighted mean over the positions.
    """

    def __init__(self, ds, weight: float) -> None:
        self.ds, self.weight = ds, weight
        self.loops: list[torch.Tensor] = []  # per sample: its loop tokens' positions (L,)
        for i in range(len(ds)):
            item, _ = ds.rows(i, ("input_ids", "loss_mask"))  # the token columns alone (no aux states)
            loop = answer_loops(item["input_ids"].tolist(), item["loss_mask"].tolist())
            self.loops.append(torch.tensor([t for t, x in enumerate(loop) if x], dtype=torch.long))
        self.loop_tokens = sum(len(x) for x in self.loops)

    def __len__(self) -> int:
        return len(self.ds)

    def lengths(self) -> list[int]:
        return self.ds.lengths()

    def __getitem__(self, i: int) -> dict:
        item, at = self.ds[i], self.loops[i]
        if self.weight == 0:
            item["loss_mask"] = item["loss_mask"].index_fill(0, at, 0)
        else:
            item["loss_weight"] = item["loss_mask"].float().index_fill_(0, at, self.weight)
        return item


# --------------------------------------------------------------------------- packing


def pack_bins(
    lengths: list[int], budget: int, seed: int, epoch: int, order: list[int] | None = None
) -> list[list[int]]:
    """Sample indices per bin, each bin at most `budget` tokens (lengths must be <= budget).

    First-fit decreasing: the epoch's draws (`order`, default epoch_order's plain order) by length, longest first
    (ties in the seeded epoch order), each into the first bin with room, found in O(log n) through a max-tree of
    the bins' free space. The bins come out in a seeded order, so long and short samples mix over the epoch.
    """
    order = epoch_order(len(lengths), seed, epoch) if order is None else order
    n = len(order)
    order = sorted(order, key=lambda i: -lengths[i])  # stable: ties keep the seeded order
    size = 1
    while size < max(n, 1):
        size *= 2
    free = [budget] * (2 * size)  # free[size + b]: room in bin b; free[node]: the max over its leaves
    bins: list[list[int]] = []
    for i in order:
        need, node = lengths[i], 1
        while node < size:  # descend to the leftmost bin with room
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        free[node] -= need
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    shuffle = torch.randperm(
        len(bins), generator=torch.Generator().manual_seed(seed * 100_003 + epoch + 7_919)
    ).tolist()
    return [bins[j] for j in shuffle]


def collate_packed(items: list[dict], budget: int, cap: int) -> dict:
    """One row (1, budget): the samples (each cut to `cap` tokens) back to back, then zero padding.

    position_ids restart at 0 for every sample and for the padding (its own document, loss_mask 0);
    attention_mask is 1 on real tokens.
    """
    parts = {k: [it[k][:cap] for it in items] for k in items[0] if k != "sample_id"}
    lens = [len(x) for x in parts["input_ids"]]
    pad = budget - sum(lens)
    out = {}
    for k, xs in parts.items():
        filler = xs[0].new_zeros((pad, *xs[0].shape[1:]))
        out[k] = torch.cat([*xs, filler])[None]
    out["position_ids"] = torch.cat([torch.arange(n) for n in lens] + [torch.arange(pad)])[None]
    out["attention_mask"] = (torch.arange(budget) < sum(lens)).long()[None]
    out["sample_id"] = torch.tensor([it["sample_id"] for it in items], dtype=torch.long)
    return out


def sample_spans(batch: dict) -> list[tuple[int, int]]:
    """(first flat row, length) of every real sample of a collated batch, padded or packed, in (B*T) rows."""
    mask = batch["attention_mask"]
    B, T = mask.shape
    if "position_ids" not in batch:
        return [(b * T, n) for b, n in enumerate(mask.sum(1).tolist()) if n]
    starts = ((batch["position_ids"] == 0) & mask.bool()).reshape(-1).nonzero()[:, 0].tolist()
    ends = starts[1:] + [int(mask.sum())]  # packed rows: real tokens first, padding last (collate_packed, B = 1)
    return [(a, b - a) for a, b in zip(starts, ends)]
