"""Targets: the embedded transformers model (hf.py) or SGLang servers (sglang.py), behind base.Target."""

from __future__ import annotations

from collections.abc import Callable

from eagle3ft.config import HarvestConfig, TargetConfig
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.dflash_config import DFlashConfig
from eagle3ft.targets.base import Target


class DFlashCapture:
    """A DFlash drafter's layers as the SGLang harvest client asks for them: SGLang's EAGLE3 capture (an EAGLE3
    server's draft config, or 0.5.23's aux capture) numbered so that it takes the outputs of target_layer_ids."""

    def __init__(self, spec: DFlashConfig, architectures: Callable[[], list[str] | None]):
        """architectures: the served model's, read only where the numbering differs between targets."""
        self.spec, self.ids = spec, spec.eagle3_capture_ids_on_any_target()
        if self.ids is None:
            architectures = architectures()
            self.ids = spec.eagle3_capture_ids(architectures)
        if self.ids is None:
            raise ValueError(
                f"{spec.path}: SGLang's EAGLE3 capture on {architectures} cannot take the outputs of layers "
                f"{spec.target_layer_ids} (a DeepseekV2 reads [0, ...] as layer inputs and [1, ...] shifted); "
                "use harvest.backend hf, or target_layer_ids that do not start at 0"
            )

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> list[int]:
        self.spec.check_target(hidden_size, vocab_size, num_layers)
        return list(self.ids)


def open_target(target: TargetConfig, harvest: HarvestConfig, spec: DrafterConfig | DFlashConfig) -> Target:
    """The configured backend, checked against the drafter (ValueError) before any harvesting. A DFlash drafter's
    layers are captured by its own numbering (id j = transformers' hidden_states[j + 1] on every target,
    DFlashConfig.hidden_state_indices): by the embedded target directly, through SGLang by EAGLE3 capture ids that
    name the same layers (DFlashCapture)."""
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
    if backend == "sglang":
        from eagle3ft.targets.sglang import SGLangTarget, target_architectures

        capture = DFlashCapture(spec, lambda: target_architectures(target)) if dflash else spec
        served = SGLangTarget(target, harvest.sglang, capture)
        info = served.info
        spec.check_target(info.hidden_size, info.vocab_size, info.num_layers)
        return served
    raise ValueError(f"harvest.backend {backend!r}: expected hf or sglang")
