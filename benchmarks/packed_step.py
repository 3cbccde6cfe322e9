#!/usr/bin/env python3
"""The small drafter's train step, padded against packed, and the online prefill's cost (issue 13).

Same documents, same drafter, one optimizer step per micro-batch (forward + backward + AdamW), real tokens/s
(padding excluded), median over rounds, padded and packed interleaved (A B A B ...):
  padded  micro-batches of --micro docs in a seeded order, right-padded to the longest (data/store.py collate:
          run 2's layout);
  packed  train/batching.py's first-fit-decreasing bins of --pack-tokens each (collate_packed), document-causal
          attention (varlen flash on CUDA).
With --config (a target config, e.g. configs/smollm2-135m.yaml) it also times train/data.py's OnlineTarget
prefill of the packed micro-batches: the online mode's extra work per token.

Documents: the lengths of RUN/tokens' train split with --run-dir, else --docs lognormal lengths
(median --median-len, cut to [16, --max-len]); features are random (timing only).

    python benchmarks/packed_step.py --out $OUT                                   # H200: SmolLM2 drafter, bf16
    python benchmarks/packed_step.py --config configs/smollm2-135m.yaml --out $OUT  # plus the online prefill
    python benchmarks/packed_step.py --device cpu --drafter configs/drafters/tiny.json --docs 32 \
        --pack-tokens 1024 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", default="configs/drafters/smollm2-135m.json")
    p.add_argument("--config", default=None, help="a run config whose target to time the online prefill with")
    p.add_argument("--run-dir", default=None, help="take document lengths from RUN/tokens (train split)")
    p.add_argument("--docs", type=int, default=512)
    p.add_argument("--median-len", type=int, default=600)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--micro", type=int, default=16, help="docs per padded micro-batch")
    p.add_argument("--pack-tokens", type=int, default=65536)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT"))
    return p.parse_args()


def doc_lengths(a) -> list[int]:
    if a.run_dir:
        from eagle3ft.data.tokens import TokenStore

        return [
            min(n, a.max_len) for n in TokenStore(Path(a.run_dir) / "tokens", verify=False).dataset("train").lengths()
        ]
    g = torch.Generator().manual_seed(a.seed)
    x = torch.randn(a.docs, generator=g).mul(0.8).exp().mul(a.median_len)
    return x.clamp(16, a.max_len).long().tolist()


def documents(lengths, model, topk, seed) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    c = model.config
    target_ids = torch.arange(c.draft_vocab_size) + model.d2t  # the draft vocab's target ids
    docs = []
    for i, n in enumerate(lengths):
        lp, j = torch.randn(n, 64, generator=g).mul(3).log_softmax(-1).topk(topk, -1)
        mask = torch.ones(n, dtype=torch.long)
        mask[: n // 4] = 0
        docs.append(
            {
                "sample_id": i,
                "input_ids": target_ids[torch.randint(0, c.draft_vocab_size, (n,), generator=g)],
                "loss_mask": mask,
                "aux_hidden": torch.randn(n, 3 * c.target_hidden_size, generator=g).bfloat16(),
                "topk_ids": target_ids[j],
                "topk_logprobs": lp,
            }
        )
    return docs


def main() -> None:
    a = parse()
    sys.path.insert(0, str(REPO))
    from eagle3ft.data.store import collate
    from eagle3ft.drafter.config import DrafterConfig
    from eagle3ft.drafter.model import Eagle3Drafter
    from eagle3ft.train.batching import collate_packed, epoch_order, pack_bins
    from eagle3ft.train.ttt import ttt_forward

    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(a.seed)
    model = Eagle3Drafter(DrafterConfig.from_json(REPO / a.drafter))
    with torch.no_grad():
        model.embed_tokens.weight.normal_()
        vd, V = model.config.draft_vocab_size, model.config.vocab_size
        model.d2t.copy_(torch.randperm(V)[:vd].sort().values - torch.arange(vd))
        model.t2d.zero_()[torch.arange(vd) + model.d2t] = True
    model = model.to(dev, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), **({"fused": True} if dev.type == "cuda" else {}))

    lengths = doc_lengths(a)
    docs = documents(lengths, model, a.topk, a.seed)
    cap = min(a.max_len, a.pack_tokens)
    order = epoch_order(len(docs), a.seed, 0)
    layouts = {
        "padded": [
            collate([docs[i] for i in order[s : s + a.micro]], max_len=a.max_len) for s in range(0, len(docs), a.micro)
        ],
        "packed": [
            collate_packed([docs[i] for i in b], budget=a.pack_tokens, cap=cap)
            for b in pack_bins([min(n, cap) for n in lengths], a.pack_tokens, a.seed, 0)
        ],
    }

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def one_pass(batches) -> float:
        sync()
        t = time.perf_counter()
        for b in batches:
            b = {k: v.to(dev, non_blocking=True) for k, v in b.items() if k != "sample_id"}
            out = ttt_forward(model, b, steps=a.ttt_steps)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t

    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "drafter": a.drafter,
        "docs": len(docs),
        "real_tokens": sum(min(n, cap) for n in lengths),
        "ttt_steps": a.ttt_steps,
        "layouts": {},
    }
    for name, batches in layouts.items():
        one_pass(batches[:2])  # warm-up
        slots = sum(b["input_ids"].numel() for b in batches)
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        result["layouts"][name] = {"micro_batches": len(batches), "fill": round(real / slots, 4), "times_s": []}
    for _ in range(a.rounds):  # A B A B: the same conditions for both
        for name, batches in layouts.items():
            result["layouts"][name]["times_s"].append(one_pass(batches))
    for name, r in result["layouts"].items():
        real = sum(int(b["attention_mask"].sum()) for b in layouts[name])
        r["tokens_per_s"] = round(real / statistics.median(r["times_s"]))
        r["tokens_per_s_range"] = [round(real / max(r["times_s"])), round(real / min(r["times_s"]))]
    result["max_mem_gib"] = (
        round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None
    )  # both layouts
    result["packed_over_padded"] = round(
        result["layouts"]["packed"]["tokens_per_s"] / result["layouts"]["padded"]["tokens_per_s"], 2
    )

    if a.config:  # the online mode's prefill, on the packed micro-batches' tokens
        from eagle3ft.config import load_config
        from eagle3ft.train.data import OnlineTarget

        cfg = load_config(REPO / a.config, [f"harvest.topk={a.topk}"])
        online = OnlineTarget(cfg.target, cfg.drafter, cfg.harvest).to(dev)
        token_batches = [{k: b[k] for k in ("input_ids", "attention_mask", "position_ids")} for b in layouts["packed"]]
        online.features({k: v.to(dev) for k, v in token_batches[0].items()}, dev)  # warm-up
        times = []
        for _ in range(a.rounds):
            sync()
            t = time.perf_counter()
            for b in token_batches:
                online.features({k: v.to(dev) for k, v in b.items()}, dev)
            sync()
            times.append(time.perf_counter() - t)
        packed = result["layouts"]["packed"]
        prefill = sum(int(b["attention_mask"].sum()) for b in token_batches) / statistics.median(times)
        result["online_prefill"] = {
            "target": cfg.target.name,
            "tokens_per_s": round(prefill),
            "times_s": times,
            "packed_step_with_prefill_tokens_per_s": round(1 / (1 / packed["tokens_per_s"] + 1 / prefill)),
        }
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "packed_step.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
