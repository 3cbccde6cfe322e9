"""Each sample's source, and a split's samples grouped by it: the held-out sets by source that held-out τ, the
comparison and the demo measure (HumanEval apart from MT-Bench), and the train split's sources that online training
weights.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from eagle3ft.config import HarvestConfig
from eagle3ft.data.prompts import collect, source_name
from eagle3ft.data.store import FeatureStore


def sample_id(key: str) -> int:
    """A conversation's sample id in the stores: its key's first 60 bits (a positive int64)."""
    return int(key[:15], 16)


def sample_sources(store: FeatureStore, h: HarvestConfig, split: str) -> list[str | None]:
    """The source name (data/prompts.py source_name) of each sample of a feature store's `split`, in dataset order:
    as the harvest recorded it, else (a store written before it recorded them) found again from the sample ids of
    every record of `h.sources` that can reach the split, keyed as the harvest keys them; None where neither has it.
    """
    names = store.sources(split)
    if all(n is not None for n in names):
        return names
    by_id: dict[int, str] = {}
    for src in h.sources:
        if src.kind == "tokens" or src.split not in ("auto", split):
            continue
        if split == "heldout" and src.split == "auto" and h.heldout_fraction <= 0:
            continue
        every = dataclasses.replace(src, limit=None, split=split, exclude_heldout=False)
        convs = collect(
            [every], max_turns=h.max_turns, regenerate=h.regenerate, heldout_fraction=0.0, dedupe=False, skips=Counter()
        )
        for c in convs:
            by_id.setdefault(sample_id(c.key), source_name(src))
    ids = [row[3] for row in store.dataset(split, keys=("input_ids",)).index]
    return [n if n is not None else by_id.get(i) for n, i in zip(names, ids)]


def group_by_source(names: list[str | None]) -> dict[str, list[int]]:
    """Indices of a dataset per source name ("other" where a sample's source is not known), given each sample's
    source in dataset order (sample_sources)."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(name or "other", []).append(i)
    return groups


def heldout_sets(store: FeatureStore, h: HarvestConfig) -> dict[str, list[int]]:
    """The held-out split's sample indices per source; ValueError when the store has no held-out samples."""
    groups = group_by_source(sample_sources(store, h, "heldout"))
    if not groups:
        raise ValueError(f"{store.dir} has no held-out samples (harvest.sources with split heldout)")
    return groups
