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
from safetensors.torch import load_file, save

from eagle3ft.files import safetensors_keys, write_atomic


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


def grow_vocab(
    d2t: torch.Tensor, token_counts: torch.Tensor, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A larger draft vocabulary holding every token of (d2t, t2d) plus the most frequent others (ties: lower id
    first), sorted by id: (d2t, t2d, where (old Vd,): the new draft id of each old draft id)."""
    old = torch.arange(d2t.numel()) + d2t  # (old Vd,) target ids, ascending
    if draft_vocab_size < old.numel():
        raise ValueError(f"draft_vocab_size {draft_vocab_size} < the {old.numel()} tokens of the vocabulary it grows")
    counts = token_counts.to(torch.int64).clone()
    counts[old] = torch.iinfo(torch.int64).max  # kept first, whatever their counts
    d2t_new, t2d_new = build_vocab(counts, draft_vocab_size)
    new_ids = torch.arange(draft_vocab_size) + d2t_new
    return d2t_new, t2d_new, torch.searchsorted(new_ids, old)


def save_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, tmp_name: str | None = None) -> None:
    """Atomically (eagle3ft/files.py: write_atomic; `tmp_name` when several ranks write it at once)."""
    tensors = {"d2t": d2t.to(torch.int64).contiguous(), "t2d": t2d.to(torch.bool).contiguous()}
    write_atomic(path, save(tensors), tmp_name)


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t/t2d of a vocab file; DamagedFile or ValueError naming the file when it is truncated or lacks one."""
    keys = safetensors_keys(path, "the draft vocabulary")
    missing = [k for k in ("d2t", "t2d") if k not in keys]
    if missing:
        raise ValueError(f"{path}: the draft vocabulary has no {', '.join(missing)}")
    t = load_file(str(path))
    return t["d2t"], t["t2d"]


def vocab_from_drafter(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """d2t/t2d of an existing drafter checkpoint (SGLang form), unchanged."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else [folder]
    if not files or not files[0].is_file():
        raise FileNotFoundError(f"drafter checkpoint {folder}: no *.safetensors weights")
    found: dict[str, torch.Tensor] = {}
    for f in files:
        keys = safetensors_keys(f, "the drafter's weights file")  # every file: a truncated one is named here, not later
        with safe_open(f, framework="pt") as h:
            for k in ("d2t", "t2d"):
                if k in keys:
                    found[k] = h.get_tensor(k)
    missing = [k for k in ("d2t", "t2d") if k not in found]
    if missing:
        raise FileNotFoundError(f"drafter checkpoint {folder} has no {', '.join(missing)}")
    if found["d2t"].dtype.is_floating_point:
        raise ValueError(f"drafter checkpoint {folder}: d2t is {found['d2t'].dtype}, not an integer tensor")
    return found["d2t"].to(torch.int64), found["t2d"].to(torch.bool)


def check_vocab(
    d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, draft_vocab_size: int, where: str = "draft vocabulary"
) -> None:
    """Raise ValueError naming `where` unless d2t/t2d describe the same `draft_vocab_size` tokens of a `vocab_size`
    target:
    integer d2t of draft_vocab_size entries, bool t2d of vocab_size, every d2t[i] + i a distinct target id in range
    that t2d marks, and t2d marking no other."""
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool or d2t.dim() != 1:
        raise ValueError(f"{where}: d2t must be a 1-D integer tensor, got {d2t.dtype} of shape {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1:
        raise ValueError(f"{where}: t2d must be a 1-D bool tensor, got {t2d.dtype} of shape {tuple(t2d.shape)}")
    if d2t.numel() != draft_vocab_size or t2d.numel() != vocab_size:
        raise ValueError(
            f"{where}: vocab sizes d2t {d2t.numel()} / t2d {t2d.numel()} != draft {draft_vocab_size} / target "
            f"{vocab_size}"
        )
    target_ids = torch.arange(draft_vocab_size) + d2t.to(torch.int64)
    out = ((target_ids < 0) | (target_ids >= vocab_size)).nonzero().flatten()
    if out.numel():
        i = int(out[0])
        raise ValueError(
            f"{where}: d2t maps {out.numel()} draft ids outside the target vocab [0, {vocab_size}), first draft id {i} "
            f"-> {int(target_ids[i])}"
        )
    if int(target_ids.unique().numel()) != draft_vocab_size:
        raise ValueError(
            f"{where}: d2t maps several draft ids to one target id ({int(target_ids.unique().numel())} distinct of "
            f"{draft_vocab_size})"
        )
    unmarked = (~t2d[target_ids]).nonzero().flatten()
    if unmarked.numel():
        i = int(unmarked[0])
        raise ValueError(
            f"{where}: d2t and t2d disagree: {unmarked.numel()} draft ids map to target ids t2d does not mark, first "
            f"draft id {i} -> {int(target_ids[i])}"
        )
    if int(t2d.sum()) != draft_vocab_size:
        raise ValueError(
            f"{where}: d2t and t2d disagree: t2d marks {int(t2d.sum())} target ids, d2t maps {draft_vocab_size}"
        )
