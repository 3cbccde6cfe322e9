#!/usr/bin/env python3
"""A Kimi-K2-shaped run folder with synthetic features, for `accelerate launch train/finetune.py` at real dims.

    python benchmarks/k2_synthetic.py --run-dir /tmp/k2 --samples 48 --seq 2048

Writes, from a seed:
  RUN/target/            config.json + model.safetensors holding only `model.embed_tokens.weight`
                         [163840, 7168] bf16: what training reads of the target (train.build.build_drafter)
  RUN/features/          a feature store (data/store.py schema) of `--samples` sequences of `--seq` tokens:
                         random token ids, aux states N(0, 1) bf16 [T, 3 x 7168], top-K log-probs of a
                         random softmax whose argmax lies in the draft vocabulary, loss_mask 1 after the
                         first quarter (a prompt, then an answer)
  RUN/vocab.safetensors  the draft vocabulary built from the answer tokens (eagle3ft/drafter/vocab.py)

The dims come from the drafter config (configs/drafters/kimi-k2.json), as benchmarks/train_speed/train_speed.py's K2
preset does; the numbers trained on mean nothing, the step's shapes and memory are the point (issue 16).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3ft.config import resolve_path
from eagle3ft.data.store import SPLITS
from eagle3ft.data.store_writer import FeatureWriter, Sample
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.vocab import build_vocab, save_vocab


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--drafter", default="configs/drafters/kimi-k2.json")
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--heldout", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--num-layers", type=int, default=61, help="the target's decoder layers (K2: 61)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    run = Path(a.run_dir)
    dcfg = DrafterConfig.from_json(resolve_path(a.drafter))
    V, Ht, Vd = dcfg.vocab_size, dcfg.target_hidden_size, dcfg.draft_vocab_size
    g = torch.Generator().manual_seed(a.seed)

    tgt = run / "target"
    tgt.mkdir(parents=True, exist_ok=True)
    (tgt / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": Ht,
                "vocab_size": V,
                "num_hidden_layers": a.num_layers,
                "tie_word_embeddings": False,
            },
            indent=1,
        )
    )
    if not (tgt / "model.safetensors").is_file():
        emb = (torch.randn(V, Ht, generator=g) * 0.02).to(torch.bfloat16)
        save_file({"model.embed_tokens.weight": emb}, str(tgt / "model.safetensors"))
        del emb

    draft_ids = torch.sort(torch.randperm(V, generator=g)[:Vd]).values  # the tokens answers are drawn from
    target = {
        "name": "synthetic-k2",
        "hidden_size": Ht,
        "vocab_size": V,
        "num_layers": a.num_layers,
        "aux_layer_ids": list(dcfg.aux_layer_ids),
    }
    if (run / "features").exists():
        raise SystemExit(f"{run / 'features'} exists: use a new --run-dir")
    writer = FeatureWriter(run / "features", target, a.topk, False, f"synthetic-k2-seed{a.seed}-{a.samples}x{a.seq}")
    counts = torch.zeros(V, dtype=torch.int64)
    sid = 0
    for split, n in zip(SPLITS, (a.samples, a.heldout)):
        for chunk in range(n):
            T = a.seq
            ids = draft_ids[torch.randint(0, Vd, (T,), generator=g)]
            mask = torch.zeros(T, dtype=torch.uint8)
            mask[T // 4 :] = 1
            logits = torch.randn(T, a.topk, generator=g) * 2
            logits[:, 0] += 4  # a peaked distribution
            logp, _ = torch.sort(torch.log_softmax(logits, -1), -1, descending=True)
            topk_ids = draft_ids[torch.randint(0, Vd, (T, a.topk), generator=g)]
            topk_ids[:-1, 0] = ids[1:]  # the argmax is the next token, as on regenerated greedy data
            s = Sample(
                sid,
                ids.to(torch.int32),
                mask,
                torch.randn(T, 3 * Ht, generator=g).to(torch.bfloat16),
                topk_ids.to(torch.int32),
                logp,
            )
            if split == "train":
                counts += torch.bincount(ids[mask.bool()], minlength=V)
            writer.commit(split, chunk, [s], {})
            sid += 1
    d2t, t2d = build_vocab(counts, Vd)
    save_vocab(run / "vocab.safetensors", d2t, t2d)
    writer.finish(counts)
    print(json.dumps({"run_dir": str(run), "samples": a.samples, "seq": a.seq, "target": str(tgt)}))


if __name__ == "__main__":
    main()
