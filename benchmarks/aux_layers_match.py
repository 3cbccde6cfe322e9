"""Do two feature stores of the same conversations hold the same aux layers? SGLang's capture against the embedded one.

    python benchmarks/aux_layers_match.py runs/k2r-sglang/features runs/k2r-hf/features

Harvest the same conversations twice with harvest.regenerate false (the same ids, no generation), once through an
SGLang server and once embedded (harvest.backend hf: forward hooks, aux id i == output of decoder layer i), on the
same weights. For each pair (chunk i of A, chunk j of B) it sums |A_i - B_j| and |B_j| over every stored token: the
relative distance is small on the diagonal only when both name the same layers, and an off-by-one in either
capture moves the smallest distance of each row off the diagonal. Prints the matrix and a verdict as JSON; exits 1
when the layers differ.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from eagle3ft.data.store import SPLITS, FeatureStore


def distances(a: FeatureStore, b: FeatureStore) -> list[list[float]]:
    """(k, k) relative L1 distance between aux chunk i of `a` and chunk j of `b`, summed over both splits."""
    H = a.target["hidden_size"]
    k = len(a.target["aux_layer_ids"])
    diff, norm = torch.zeros(k, k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)
    for split in SPLITS:
        if not a.manifest["counts"][split]["samples"]:
            continue
        for x, y in zip(a.dataset(split), b.dataset(split), strict=True):
            if x["sample_id"] != y["sample_id"] or not torch.equal(x["input_ids"], y["input_ids"]):
                raise ValueError(f"sample {x['sample_id']}: the stores hold different token ids")
            xa = x["aux_hidden"].double().reshape(-1, k, H)  # (T, k, H)
            ya = y["aux_hidden"].double().reshape(-1, k, H)
            diff += (xa[:, :, None] - ya[:, None]).abs().sum(dim=(0, 3))
            norm += ya.abs().sum(dim=(0, 2))
    return (diff / norm.clamp_min(1e-30)[None]).tolist()


def verdict(a_dir: str, b_dir: str) -> dict:
    a, b = FeatureStore(a_dir), FeatureStore(b_dir)
    ta, tb = a.target, b.target
    if ta["hidden_size"] != tb["hidden_size"] or len(ta["aux_layer_ids"]) != len(tb["aux_layer_ids"]):
        raise ValueError(f"the stores' targets differ in width or aux layer count: {ta} != {tb}")
    d = distances(a, b)
    nearest = [min(range(len(row)), key=row.__getitem__) for row in d]
    return {
        "aux_layer_ids": {"a": ta["aux_layer_ids"], "b": tb["aux_layer_ids"]},
        "relative_l1": [[round(v, 5) for v in row] for row in d],
        "nearest": nearest,
        "same_layers": nearest == list(range(len(d))),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="a features/ folder (e.g. the SGLang harvest)")
    ap.add_argument("b", help="a features/ folder of the same conversations (e.g. the embedded harvest)")
    args = ap.parse_args(argv)
    out = verdict(args.a, args.b)
    print(json.dumps(out, indent=1))
    sys.exit(0 if out["same_layers"] else 1)


if __name__ == "__main__":
    main()
