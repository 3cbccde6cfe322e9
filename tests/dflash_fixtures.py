"""The tiny targets (configs/tiny.yaml's random Llama, configs/tiny-deepseek.yaml's random DeepSeek-V3) and a tiny
DFlash drafter for them: target layer j's output is transformers' hidden_states[j + 1]."""

from __future__ import annotations

import json

import torch
from train_fixtures import REPO

from eagle3ft.config import load_config
from eagle3ft.drafter.dflash_config import DFlashConfig
from eagle3ft.drafter.dflash_model import DFlashDrafter
from eagle3ft.targets.hf import build_tiny

VOCAB = 49152  # the SmolLM2 tokenizer's, which both tiny targets use
MASK_ID = 16  # SmolLM2's <empty_output>: an existing id a chat answer does not produce


def tiny_target(config: str = "configs/tiny.yaml"):
    """The seeded random tiny target of a test config, in float64 and eval mode (MoE experts run eagerly: the grouped
    GEMM takes no float64)."""
    model = build_tiny(load_config(REPO / config).target, VOCAB)
    model.config._experts_implementation = "eager"
    return model.double().eval()


def tiny_dflash_config(layer_ids=(0, 1, 2), block_size: int = 4, num_layers: int = 2) -> DFlashConfig:
    return DFlashConfig.from_dict(
        {
            "architectures": ["DFlashDraftModel"],
            "hidden_size": 64,
            "num_hidden_layers": num_layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 96,
            "num_target_layers": 4,
            "block_size": block_size,
            "vocab_size": VOCAB,
            "dflash_config": {"target_layer_ids": list(layer_ids), "mask_token_id": MASK_ID},
        }
    )


def tiny_k2_dflash_config(block_size: int = 4) -> DFlashConfig:
    """configs/drafters/kimi-k25-dflash.json at the tiny DeepSeek-V3's width: its 6 layers, 8:1 query to key-value
    heads and YaRN rope (original length 16, so that these short tests reach past it), over target layers 0-2."""
    raw = json.loads((REPO / "configs/drafters/kimi-k25-dflash.json").read_text())
    raw.update(
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=96,
        num_target_layers=4,
        block_size=block_size,
        vocab_size=VOCAB,
    )
    raw["rope_scaling"] = {**raw["rope_scaling"], "original_max_position_embeddings": 16}
    raw["dflash_config"] = {"target_layer_ids": [0, 1, 2], "mask_token_id": MASK_ID, "block_size": block_size}
    return DFlashConfig.from_dict(raw)


def random_dflash(cfg: DFlashConfig, seed: int = 0, scale: float = 0.3) -> DFlashDrafter:
    torch.manual_seed(seed)
    m = DFlashDrafter(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.uniform_(0.5, 1.5) if n.endswith("norm.weight") else p.normal_(0, scale)
    return m.double()


@torch.no_grad()
def target_features(model, ids: torch.Tensor, layer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """One teacher-forced pass: ids (B, T) -> (features (B, T, K·h) = the outputs of layers `layer_ids`, ascending,
    logits (B, T, V))."""
    out = model(ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[j + 1] for j in layer_ids], -1), out.logits


def target_head(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding (V, h), LM head (V, h)) of a transformers target, detached."""
    return model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()
