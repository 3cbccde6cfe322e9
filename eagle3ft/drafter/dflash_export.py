"""A DFlash drafter folder in SGLang 0.5.17's form: config.json (dflash_config.DFlashConfig.to_hf_dict) and
model.safetensors with HF-style names and no embedding or LM head (SGLang takes both from the target).

SGLang's DFlashDraftModel.load_weights ignores a name it does not know and leaves a parameter nobody wrote at its
init value (RMSNorm ones, random linears) without a word (models/dflash.py 439-493), so `save` and `load` both check
the key set against exactly what it fills: `export_keys(cfg)`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3ft.drafter.dflash_config import DFlashConfig
from eagle3ft.drafter.dflash_model import DFlashDrafter
from eagle3ft.files import as_umask_allows, check_finite, write_json

CONFIG, WEIGHTS = "config.json", "model.safetensors"
_LAYER_KEYS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def export_keys(cfg: DFlashConfig) -> list[str]:
    """Every tensor SGLang's DFlashDraftModel fills for this config, as the folder names it (q/k/v and gate/up apart:
    its loader stacks them into qkv_proj and gate_up_proj)."""
    layers = [f"layers.{i}.{k}" for i in range(cfg.num_hidden_layers) for k in _LAYER_KEYS]
    return ["fc.weight", "hidden_norm.weight", "norm.weight", *layers]


def check_keys(keys, cfg: DFlashConfig, where: str) -> None:
    """Raise naming what SGLang would skip silently or leave at its init value."""
    keys, want = set(keys), set(export_keys(cfg))
    extra, missing = sorted(keys - want), sorted(want - keys)
    if extra or missing:
        raise ValueError(
            f"{where}: the DFlash weights do not match what SGLang loads: "
            f"skipped silently: {extra[:8]}; left at their init value: {missing[:8]}"
        )


def save(drafter: DFlashDrafter, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `folder`/config.json and model.safetensors (weights in `dtype`, default as they are); returns folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in drafter.state_dict().items()}
    check_keys(tensors, drafter.config, str(folder))
    check_finite(tensors, str(folder))
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    as_umask_allows(folder / WEIGHTS)
    write_json(folder / CONFIG, drafter.config.to_hf_dict(), newline=True)
    return folder


def write_tensors(folder: str | Path, cfg: DFlashConfig, tensors: dict[str, torch.Tensor]) -> None:
    """config.json and model.safetensors of `tensors` (a drafter's state, as a trainer gathers it) into `folder`,
    the key set checked and every weight finite first (nothing written otherwise)."""
    folder = Path(folder)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    check_keys(tensors, cfg, str(folder))
    check_finite(tensors, str(folder))
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    as_umask_allows(folder / WEIGHTS)
    write_json(folder / CONFIG, cfg.to_hf_dict(), newline=True)


def load(folder: str | Path, dtype: torch.dtype = torch.float32, allow_extra: bool = False) -> DFlashDrafter:
    """The drafter a folder holds, its key set checked as SGLang would fill it (a `model.` prefix is accepted as
    SGLang accepts it); fc's width must match the config's K. allow_extra (a published drafter to warm-start from):
    tensors SGLang would ignore are dropped instead of refused; a missing one is refused either way."""
    folder = Path(folder)
    cfg = DFlashConfig.from_json(folder / CONFIG)
    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        tensors = {k.removeprefix("model."): f.get_tensor(k) for k in f.keys()}
    if allow_extra:
        tensors = {k: v for k, v in tensors.items() if k in set(export_keys(cfg))}
    check_keys(tensors, cfg, str(folder / WEIGHTS))
    drafter = DFlashDrafter(cfg)
    want = drafter.state_dict()
    for k, v in tensors.items():
        if tuple(v.shape) != tuple(want[k].shape):
            raise ValueError(f"{folder / WEIGHTS}: {k} is {tuple(v.shape)}, the config makes it {tuple(want[k].shape)}")
    drafter.load_state_dict(tensors)
    return drafter.to(dtype)
