"""Targets: the embedded transformers model (hf.py) or SGLang servers (sglang.py), behind base.Target."""

from __future__ import annotations

from eagle3ft.config import HarvestConfig, TargetConfig
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.dflash_config import DFlashConfig
from eagle3ft.targets.base import Target


def open_target(target: TargetConfig, harvest: HarvestConfig, spec: DrafterConfig | DFlashConfig) -> Target:
    """The configured backend, checked against the drafter (ValueError) before any harvesting. A DFlash drafter's
    layers are captured by its own numbering (id j = transformers' hidden_states[j + 1] on every target,
    DFlashConfig.hidden_state_indices), through the embedded target only."""
    backend = harvest.backend
    dflash = isinstance(spec, DFlashConfig)
    if backend == "hf":
        from eagle3ft.targets.hf import HFTarget, load_target

        model, tokenizer = load_target(target)
        c = model.config
        if dflash:
            spec.check_target(c.hidden_size, c.vocab_size, c.num_hidden_layers)
            ids, points = spec.target_layer_ids, spec.hidden_state_indices()
            return HFTarget(target, ids, model=model, tokenizer=tokenizer, capture_points=points)
        ids = spec.check_target(c.hidden_size, c.vocab_size, c.num_hidden_layers)
        return HFTarget(target, ids, model=model, tokenizer=tokenizer)
    if dflash:
        raise ValueError(
            f"harvest.backend {backend} for a DFlash drafter: SGLang's aux capture without a draft (and an EAGLE3 "
            "server's) numbers layers EAGLE-3's way (inputs, not outputs, on DeepseekV2), and no DFLASH capture "
            "path (set_dflash_layers_to_capture) is wired to the harvest client; use harvest.backend hf"
        )
    if backend == "sglang":
        from eagle3ft.targets.sglang import SGLangTarget

        served = SGLangTarget(target, harvest.sglang, spec)
        info = served.info
        spec.check_target(info.hidden_size, info.vocab_size, info.num_layers)
        return served
    raise ValueError(f"harvest.backend {backend!r}: expected hf or sglang")
