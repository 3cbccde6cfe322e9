"""How much of the target's next-token distribution the stored top-K keeps.

    python benchmarks/topk_coverage.py --config configs/smollm2-135m.yaml --run-dir runs/smol

For every position whose next token is an answer token (loss_mask[t+1] = 1) in a
harvested store, the target's FULL distribution p is recomputed from input_ids,
and for K in {1, 4, 8, 16, 32, 64}:

- mass: the probability the top-K holds (mean, and the 5th percentile). A drafter
  trained to the renormalized top-K, q = p_K, accepts a sampled (T=1) draft with
  probability sum_x min(p, q) = mass, so 1 - mass bounds the acceptance lost to K.
- argmax_in_topk: the full distribution's argmax inside the STORED top-K (checks the
  stored features against a fresh fp32 computation; K up to harvest.topk).
- sampled_in_topk: tokens drawn from p at T=1 that fall inside the top-K.
- next_in_topk: the token the target actually wrote next.

Greedy (T=0) verification only needs the argmax, which any K >= 1 keeps.
Writes run_dir/benchmarks/topk_coverage.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from eagle3ft.cli import build_parser
from eagle3ft.config import load_config
from eagle3ft.data.store import FeatureStore
from eagle3ft.targets.hf import load_target

KS = (1, 4, 8, 16, 32, 64)


@torch.inference_mode()
def coverage(model, items, draws: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    stored_k = None
    acc = {k: {"mass": [], "argmax": [], "sampled": [], "next": []} for k in KS}
    for item in items:
        ids = item["input_ids"]
        pos = (item["loss_mask"][1:] == 1).nonzero().flatten()  # positions t that predict an answer token t+1
        if len(pos) == 0:
            continue
        logp = torch.log_softmax(model(input_ids=ids[None].to(device)).logits[0].float().cpu(), -1)[pos]  # (P, V)
        p = logp.exp()
        order = logp.argsort(-1, descending=True)[:, : max(KS)]  # (P, 64)
        argmax = order[:, 0]
        sampled = torch.multinomial(p, draws, replacement=True, generator=g)  # (P, draws)
        nxt = ids[pos + 1]
        stored = item["topk_ids"][pos]
        stored_k = stored.shape[1]
        for k in KS:
            top = order[:, :k]
            acc[k]["mass"].append(p.gather(1, top).sum(1))
            acc[k]["sampled"].append((sampled[:, :, None] == top[:, None, :]).any(-1).float().mean(1))
            acc[k]["next"].append((nxt[:, None] == top).any(-1).float())
            if k <= stored_k:
                acc[k]["argmax"].append((argmax[:, None] == stored[:, :k]).any(-1).float())
    rows = []
    for k in KS:
        mass = torch.cat(acc[k]["mass"])
        rows.append(
            {
                "K": k,
                "mass_mean": round(float(mass.mean()), 4),
                "mass_p05": round(float(mass.quantile(0.05)), 4),
                "argmax_in_stored_topk": round(float(torch.cat(acc[k]["argmax"]).mean()), 4)
                if acc[k]["argmax"]
                else None,
                "sampled_in_topk": round(float(torch.cat(acc[k]["sampled"]).mean()), 4),
                "next_in_topk": round(float(torch.cat(acc[k]["next"]).mean()), 4),
            }
        )
    return {"positions": int(sum(len(m) for m in acc[KS[0]]["mass"])), "stored_topk": stored_k, "rows": rows}


def main() -> None:
    ap = build_parser("Top-K coverage of the target distribution on harvested features.")
    ap.add_argument("--split", default="train")
    ap.add_argument("--max-samples", type=int, default=None)
    ap.add_argument("--draws", type=int, default=16, help="tokens sampled from p per position")
    args = ap.parse_args()
    cfg = load_config(args.config, args.overrides)
    run = Path(args.run_dir)
    ds = FeatureStore(run / "features").dataset(args.split)
    n = len(ds) if args.max_samples is None else min(len(ds), args.max_samples)
    model, _ = load_target(cfg.target)
    t0 = time.time()
    result = coverage(model, (ds[i] for i in range(n)), args.draws, cfg.seed)
    result.update(
        {
            "target": cfg.target.name,
            "split": args.split,
            "samples": n,
            "draws_per_position": args.draws,
            "time_s": round(time.time() - t0, 1),
        }
    )
    out = run / "benchmarks" / "topk_coverage.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(
        f"{result['positions']} answer positions, {n} samples, {cfg.target.name} (stored top-{result['stored_topk']})"
    )
    print(f"{'K':>3} {'mass mean':>10} {'mass p05':>9} {'argmax in stored':>17} {'sampled in':>11} {'next in':>8}")
    for r in result["rows"]:
        stored = "-" if r["argmax_in_stored_topk"] is None else f"{r['argmax_in_stored_topk']:.4f}"
        print(
            f"{r['K']:>3} {r['mass_mean']:>10.4f} {r['mass_p05']:>9.4f} {stored:>17} {r['sampled_in_topk']:>11.4f} "
            f"{r['next_in_topk']:>8.4f}"
        )


if __name__ == "__main__":
    main()
