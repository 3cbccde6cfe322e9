"""Does Python's garbage collector run inside the embedded speculative decoder's cycles? (RESULTS §18a)

    python benchmarks/gc_probe.py [--config configs/smollm2-135m.yaml] [--steps 5] [--new 128] [--drafting graph]

Loads the config's target and the shipped drafter, warms the decoder up with one short generation, then times every
collection (gc.callbacks) during one generation of --new tokens and prints, per generation of the collector, how
many ran, their total and their longest time, beside the cycles the generation took.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from eagle3ft.config import load_config
from eagle3ft.drafter.folder import DrafterFolder
from eagle3ft.eval.decode.speculate import SpeculativeDecoder
from eagle3ft.targets.hf import load_target

PROMPT = "Write a short story about a robot learning to paint."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/smollm2-135m.yaml")
    ap.add_argument("--drafter", default="drafters/smollm2-135m")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--drafting", default="graph", choices=["graph", "eager"])
    args = ap.parse_args()

    cfg = load_config(args.config)
    model, tok = load_target(cfg.target)
    drafter, aux = DrafterFolder(args.drafter, "--drafter").check().on_target(model)
    dec = SpeculativeDecoder(model, drafter, aux, steps=args.steps, drafting=args.drafting)
    ids = tok(PROMPT)["input_ids"]
    dec.generate(ids, 16)

    started, spent = {}, {}

    def timed(phase: str, info: dict) -> None:
        g = info["generation"]
        if phase == "start":
            started[g] = time.perf_counter()
        else:
            spent.setdefault(g, []).append(time.perf_counter() - started[g])

    gc.callbacks.append(timed)
    t = time.perf_counter()
    out = dec.generate(ids, args.new)
    wall = time.perf_counter() - t
    gc.callbacks.remove(timed)
    print(json.dumps({
        "tracked_objects": len(gc.get_objects()), "cycles": out.verify_count, "new_tokens": len(out.tokens),
        "wall_s": round(wall, 3),
        "collections": {str(g): {"count": len(v), "total_ms": round(1e3 * sum(v), 2), "max_ms": round(1e3 * max(v), 2)}
                        for g, v in sorted(spent.items())},
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
