"""Targets: the embedded transformers model (hf.py) or SGLang servers (sglang.py), behind base.Target."""

from __future__ import annotations

from eagle3ft.config import Config
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.targets.base import Target


def open_target(cfg: Config, spec: DrafterConfig) -> Target:
    """The configured backend, checked against the drafter (ValueError) before any harvesting."""
    backend = cfg.harvest.backend
    if backend == "hf":
        from eagle3ft.targets.hf import HFTarget, load_target

        model, tokenizer = load_target(cfg.target)
        c = model.config
        ids = spec.check_target(c.hidden_size, c.vocab_size, c.num_hidden_layers)
        return HFTarget(cfg.target, ids, model=model, tokenizer=tokenizer)
    if backend == "sglang":
        from eagle3ft.targets.sglang import SGLangTarget

        target = SGLangTarget(cfg.target, cfg.harvest.sglang, spec)
        info = target.info
        spec.check_target(info.hidden_size, info.vocab_size, info.num_layers)
        return target
    raise ValueError(f"harvest.backend {backend!r}: expected hf or sglang")
