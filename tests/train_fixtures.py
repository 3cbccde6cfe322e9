"""Small synthetic feature stores in the store's real format, for the train tests.

The tiny target (configs/tiny.yaml: hidden 64, 4 layers, SmolLM2 vocab) with aux ids [0, 1, 2].
The next-token targets are a fixed function of the aux features, so a drafter can learn them.
"""

from __future__ import annotations

import math
import socket
import subprocess
import sys
from pathlib import Path

import torch

from eagle3ft.data.store_writer import FeatureWriter, Sample
from eagle3ft.drafter.vocab import build_vocab, save_vocab

REPO = Path(__file__).resolve().parent.parent
TINY_TARGET = {
    "name": "tiny-llama",
    "hidden_size": 64,
    "vocab_size": 49152,
    "num_layers": 4,
    "aux_layer_ids": [0, 1, 2],
}


def write_store(
    run_dir: Path,
    n_train: int = 16,
    n_heldout: int = 2,
    seq: int = 24,
    topk: int = 4,
    draft_vocab: int = 512,
    seed: int = 0,
    target: dict | None = None,
    sources: dict[str, tuple[str, ...]] | None = None,
) -> Path:
    """run_dir/features (+ vocab.safetensors) with `n_train` + `n_heldout` samples of length ~seq; with `sources`
    (split -> names), sample i of a split is recorded as coming from names[i % len(names)]."""
    target = target or TINY_TARGET
    g = torch.Generator().manual_seed(seed)
    H, V = target["hidden_size"], target["vocab_size"]
    hot = torch.randperm(V, generator=g)[:draft_vocab]  # the tokens the text uses
    proj = torch.randn(3 * H, draft_vocab, generator=g) / math.sqrt(3 * H)
    writer = FeatureWriter(run_dir / "features", target, topk, False, f"synthetic-{seed}")
    counts = torch.zeros(V, dtype=torch.int64)
    sid = 0
    for split, n in (("train", n_train), ("heldout", n_heldout)):
        samples = []
        names = (sources or {}).get(split)
        for i in range(n):
            T = seq + int(torch.randint(-4, 5, (1,), generator=g))
            aux = torch.randn(T, 3 * H, generator=g)
            logits = 4 * aux @ proj  # (T, draft_vocab)
            lp, idx = torch.log_softmax(logits, -1).topk(topk, -1)
            ids = hot[torch.randint(0, draft_vocab, (T,), generator=g)]
            ids[1:] = hot[idx[:-1, 0]]  # the text follows the target's greedy choice
            mask = torch.zeros(T, dtype=torch.uint8)
            mask[T // 3 :] = 1
            counts.index_add_(0, ids[mask.bool()], torch.ones(int(mask.sum()), dtype=torch.int64))
            source = names[i % len(names)] if names else None
            samples.append(Sample(sid, ids, mask, aux.bfloat16(), hot[idx], lp, source=source))
            sid += 1
        writer.commit(split, 0, samples, {})
    writer.finish(counts)
    d2t, t2d = build_vocab(counts, draft_vocab)
    save_vocab(run_dir / "vocab.safetensors", d2t, t2d)
    return run_dir / "features"


def launch_cmd(
    run_dir: Path,
    *overrides: str,
    procs: int = 2,
    config: str = "configs/tiny.yaml",
    accelerate_config: str | Path = "configs/accelerate/cpu-2proc.yaml",
) -> list[str]:
    """The `accelerate launch` train/finetune.py command line (procs processes on a free port), wandb disabled."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / accelerate_config),
        "--num_processes",
        str(procs),
        "--main_process_port",
        str(port),
        str(REPO / "train/finetune.py"),
        "--config",
        str(REPO / config),
        "--run-dir",
        str(run_dir),
        "--set",
        "train.logging.wandb_mode=disabled",
    ]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


def launch(
    run_dir: Path,
    *overrides: str,
    procs: int = 2,
    config: str = "configs/tiny.yaml",
    extra: tuple = (),
    timeout: int = 600,
    accelerate_config: str | Path = "configs/accelerate/cpu-2proc.yaml",
) -> subprocess.CompletedProcess:
    """Run train/finetune.py for real under `accelerate launch` (procs processes; CPU ones by default)."""
    cmd = launch_cmd(run_dir, *overrides, procs=procs, config=config, accelerate_config=accelerate_config)
    return subprocess.run(cmd + list(extra), cwd=REPO, capture_output=True, text=True, timeout=timeout)
