"""The draft vocabulary: which target tokens the drafter's lm_head can emit.

``d2t`` int64[draft_vocab]: target_id = draft_id + d2t[draft_id].
``t2d`` bool[vocab]: True where a target token is in the draft vocabulary.
Built from loss-masked token counts (the most frequent, sorted by token id),
or copied unchanged from an existing drafter: rebuilding it for a warm start
would misalign every lm_head row without any error.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def build_vocab(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top `draft_vocab_size` tokens by count (ties: lower id first), sorted by id.

    Unseen tokens fill the remainder in id order, so the size is always exact.
    """
    counts = token_counts.to(torch.int64)
    vocab = counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} not in (0, {vocab}]")
    order = torch.argsort(-counts, stable=True)  # count descending, ties by id ascending
    chosen = torch.sort(order[:draft_vocab_size]).values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def save_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
    save_file({"d2t": d2t.to(torch.int64).contiguous(), "t2d": t2d.to(torch.bool).contiguous()}, str(path))


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    t = load_file(str(path))
    return t["d2t"], t["t2d"]


def vocab_from_drafter(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t/t2d of an existing drafter checkpoint (SGLang form), unchanged."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else [folder]
    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            for k in ("d2t", "t2d"):
                if k in h.keys():
                    found[k] = h.get_tensor(k)
    missing = [k for k in ("d2t", "t2d") if k not in found]
    if missing:
        raise FileNotFoundError(f"drafter checkpoint {folder} has no {', '.join(missing)}")
    return found["d2t"].to(torch.int64), found["t2d"].to(torch.bool)


def check_vocab(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> None:
    """Raise ValueError unless d2t/t2d describe the same `draft_vocab_size` tokens of a `vocab_size` target."""
    if d2t.numel() != draft_vocab_size or t2d.numel() != vocab_size:
        raise ValueError(f"vocab sizes d2t {d2t.numel()} / t2d {t2d.numel()} != draft {draft_vocab_size} / target {vocab_size}")
    target_ids = torch.arange(draft_vocab_size) + d2t
    if int(t2d.sum()) != draft_vocab_size or not bool(t2d[target_ids].all()):
        raise ValueError("d2t and t2d disagree")
