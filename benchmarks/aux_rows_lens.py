"""Does the harvest's aux row check (data/aux_rows.py) tell rows at their tokens from rows moved by one, on a real
target? The logit lens of each aux layer against the stored top-1 of rows t-1, t, t+1, for a feature store's rows as
stored and moved by -2..2 positions (what a server's off-by-one would hand the harvest).

    python benchmarks/aux_rows_lens.py --config configs/smollm2-135m.yaml --run-dir RUN [--set k=v ...] [--samples N]

RUN holds a harvest of that config (RUN/features). Prints one JSON line per (aux layer, shift) with the counts and
whether the check would refuse.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch

from eagle3ft.config import load_config
from eagle3ft.data.aux_rows import lens_of_model, row_offsets, shifted
from eagle3ft.data.store import FeatureStore
from eagle3ft.targets.hf import load_target


def moved(rows: torch.Tensor, by: int) -> torch.Tensor:
    """rows[t + by] at row t, the edge row repeated: a server's rows moved by `by` with their count kept."""
    if by > 0:
        return torch.cat([rows[by:], rows[-1:].expand(by, -1)])
    if by < 0:
        return torch.cat([rows[:1].expand(-by, -1), rows[:by]])
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--samples", type=int, default=64)
    a = ap.parse_args(argv)
    cfg = load_config(a.config, a.sets)
    store = FeatureStore(f"{a.run_dir}/features")
    ids, H = store.manifest["target"]["aux_layer_ids"], store.manifest["target"]["hidden_size"]
    lens = lens_of_model(load_target(cfg.target)[0])
    counts = {(j, by): Counter() for j in range(len(ids)) for by in (-2, -1, 0, 1, 2)}
    for n, item in enumerate(store.dataset("train")):
        if n >= a.samples:
            break
        aux, top1 = item["aux_hidden"].float(), item["topk_ids"][:, 0]
        for j, by in counts:
            counts[j, by] += row_offsets(moved(aux[:, j * H : (j + 1) * H], by), top1, lens)
    out = []
    for (j, by), c in counts.items():
        n = sum(c.values())
        row = {"aux_layer": ids[j], "moved_by": by, **{k: c[k] for k in ("before", "here", "after")}, "rows": n}
        row["here_share"] = round(c["here"] / max(n, 1), 3)
        row["refused"] = shifted(c) is not None
        print(json.dumps(row))
        out.append(row)
    return out


if __name__ == "__main__":
    main()
