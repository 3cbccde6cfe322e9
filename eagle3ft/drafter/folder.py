"""A drafter folder in SGLang's form (config.json + *.safetensors): the one place that opens one.

`DrafterFolder(path, where)` reads config.json once; `.check(target, features)` is the one check before any compute
(the config against the target or the feature store, the draft vocabulary, finite weights, the weights' shapes);
`.load(embedding)` builds the model from the config already read. Train's warm start, held-out τ, the offline eval,
the comparison, the demo and the bench all open their drafters here.

`kind` is config.json's architectures[0]: the layout, and so the model class and the loader's key rules
(export.py's LAYOUTS). A kind that model.py cannot build is still read and checked against a target (SGLang may
serve it); `load` refuses it. `family` is the drafter kind the stages branch on: "dflash" for SGLang's
DFlashDraftModel (dflash_config.DFlashConfig, dflash_export), "eagle3" for every EAGLE-3 layout (DrafterConfig).
`read_spec(path)` reads an architecture json of either family; `drafter_spec(section)` is the run's drafter section
read so (a DFlash config refuses the EAGLE-3-only overrides and a warm start from an EAGLE-3 folder, in one line).
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3ft.drafter import dflash_export
from eagle3ft.drafter.config import DrafterConfig, check_drafter
from eagle3ft.drafter.dflash_config import DFLASH, DFlashConfig
from eagle3ft.drafter.export import CONFIG, LAYOUTS, check_weight_shapes, drafter_tensors, load_drafter, write_drafter
from eagle3ft.drafter.vocab import check_vocab, vocab_from_drafter
from eagle3ft.files import check_finite_file, read_json, read_json_object
from eagle3ft.run_dir import RunDir

EAGLE3, DFLASH_KIND = "eagle3", "dflash"
# the drafter section's keys that only an EAGLE-3 drafter has (its draft vocabulary, EAGLE-3.1 options, grown layers)
EAGLE3_ONLY = ("draft_vocab_size", "fc_norm", "norm_output", "num_hidden_layers")


def family_of(raw: dict) -> str:
    """The drafter kind of a config.json's contents: dflash for architectures ["DFlashDraftModel"], else eagle3."""
    return DFLASH_KIND if (raw.get("architectures") or [None])[0] == DFLASH else EAGLE3


def read_spec(path: str | Path, draft_vocab_size: int | None = None) -> DrafterConfig | DFlashConfig:
    """An architecture json (or a folder's config.json) of either kind, by its architectures."""
    raw = read_json_object(path, "drafter config")
    if family_of(raw) == DFLASH_KIND:
        return DFlashConfig.from_dict(raw, str(path))
    return DrafterConfig.from_dict(raw, draft_vocab_size, str(path))


def spec_family(spec: DrafterConfig | DFlashConfig) -> str:
    return DFLASH_KIND if isinstance(spec, DFlashConfig) else EAGLE3


def drafter_spec(section, resolve=Path) -> DrafterConfig | DFlashConfig:
    """The run's drafter section (eagle3ft.config.DrafterSection) read: drafter.config's kind decides; a DFlash config
    refuses the EAGLE-3-only keys, and drafter.init must be a drafter of the same kind (one line each)."""
    spec = read_spec(resolve(section.config), section.draft_vocab_size)
    family = spec_family(spec)
    if family == DFLASH_KIND:
        if set_keys := [k for k in EAGLE3_ONLY if getattr(section, k) is not None]:
            raise ValueError(
                f"drafter.config {section.config} is a DFlash drafter; drafter.{', drafter.'.join(set_keys)} "
                "apply to EAGLE-3 drafters only"
            )
    if section.init:
        init = resolve(section.init)
        raw = (
            read_json(Path(init) / CONFIG, "the warm-start drafter's config") if (Path(init) / CONFIG).is_file() else {}
        )
        if raw and family_of(raw) != family:
            raise ValueError(
                f"drafter.init {init} is a {family_of(raw)} drafter but drafter.config {section.config} is a "
                f"{family} one: warm-start from a drafter of the kind being trained"
            )
    return spec


def write_folder(folder: Path, spec: DrafterConfig | DFlashConfig, state: dict, prefix: str = "") -> None:
    """A drafter's folder in SGLang's form from a (possibly wrapped) state dict, by its kind: the trainer's
    checkpoints, export and best export."""
    if isinstance(spec, DFlashConfig):
        tensors = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        dflash_export.write_tensors(folder, spec, tensors)
    else:
        write_drafter(folder, spec, drafter_tensors(state, prefix=prefix))


class DrafterFolder:
    """One drafter folder: `config` (its DrafterConfig, read once), `path`, `where` (the option that named it, in
    every message)."""

    def __init__(self, path: str | Path, where: str = "drafter"):
        self.path, self.where = Path(path), where
        if not (self.path / CONFIG).is_file():
            raise FileNotFoundError(f"{where}: {self.path} has no {CONFIG} (expected a drafter in SGLang's form)")
        self.config = read_spec(self.path / CONFIG)

    @classmethod
    def of_run(cls, run_dir: str | Path, checkpoint: str, where: str = "eval.checkpoint") -> DrafterFolder:
        """The evaluated drafter of a run: `checkpoint` (eval.checkpoint) resolved against the run folder."""
        if not checkpoint:
            raise ValueError(f"{where}: name the drafter folder to evaluate")
        return cls(RunDir(run_dir).drafter(checkpoint), where)

    @property
    def kind(self) -> str:
        """The layout: config.json's architectures[0]."""
        return DFLASH if self.family == DFLASH_KIND else self.config.architecture

    @property
    def family(self) -> str:
        """The drafter kind the stages branch on: dflash or eagle3."""
        return spec_family(self.config)

    def require(self, family: str, why: str) -> DrafterFolder:
        """self when it is a `family` drafter, else a one-line ValueError naming `why` it must be."""
        if self.family != family:
            raise ValueError(f"{self.where}: {self.path} is a {self.family} drafter; {why} needs a {family} one")
        return self

    def __repr__(self) -> str:
        return f"DrafterFolder({str(self.path)!r}, kind={self.kind!r})"

    def check(self, target: dict | None = None, features: str | None = None) -> DrafterFolder:
        """The one check before any compute; returns self. With `target` (hidden_size, vocab_size, num_layers, and
        aux_layer_ids when it is a feature store's identity, `features` its manifest), check_drafter against it and
        the draft vocabulary in range; without, the draft vocabulary against the folder's own sizes. Then every
        weight finite (NonFinite) and of the shape config.json gives it."""
        name = f"{self.where} {self.path}"
        if self.family == DFLASH_KIND:
            return self._check_dflash(target, features, name)
        if target is not None:
            check_drafter(self.config, target, name, features)
        d2t, t2d = vocab_from_drafter(self.path)
        if target is not None:
            check_drafter(self.config, target, name, features, d2t, t2d)
        else:
            check_vocab(d2t, t2d, self.config.vocab_size, self.config.draft_vocab_size, f"{name}: draft vocabulary")
        self.check_finite()
        check_weight_shapes(self.path, self.config)
        return self

    def _check_dflash(self, target: dict | None, features: str | None, name: str) -> DrafterFolder:
        """A DFlash folder: the config against the target (or the store's identity, whose captured ids must be its
        target_layer_ids), finite weights, the key set SGLang fills."""
        c = self.config
        if target is not None:
            try:
                c.check_target(target["hidden_size"], target["vocab_size"], target["num_layers"])
            except ValueError as e:
                raise ValueError(f"{name}: {e}{f' ({features})' if features else ''}") from None
            if features and (target.get("capture") or {}).get("kind") != DFLASH_KIND:
                raise ValueError(
                    f"{name}: a DFlash drafter, but the features were harvested for an EAGLE-3 one ({features}); "
                    "harvest with a DFlash drafter.config"
                )
            have = target.get("aux_layer_ids")
            if have is not None and list(have) != list(c.target_layer_ids):
                raise ValueError(
                    f"{name}: target_layer_ids {c.target_layer_ids} != the features' captured layers {list(have)}"
                    f"{f' ({features})' if features else ''}"
                )
        self.check_finite()
        from safetensors import safe_open

        with safe_open(str(self.path / dflash_export.WEIGHTS), framework="pt") as f:
            keys = [k.removeprefix("model.") for k in f.keys()]
        dflash_export.check_keys([k for k in keys if k in set(dflash_export.export_keys(c))], c, name)
        return self

    def check_finite(self) -> None:
        """NonFinite naming the file and tensor when a weight holds a NaN or inf: such a drafter drafts nothing
        (τ 1.0) and its numbers would look like a result. Reads one tensor at a time."""
        for f in sorted(self.path.glob("*.safetensors")):
            check_finite_file(f, f"{self.where}: the drafter's weights")

    def load(self, embedding: torch.Tensor | None = None) -> torch.nn.Module:
        """The drafter in its weights' dtype, in training mode; `embedding` (V, H) is the target's input embedding
        (an EAGLE-3 drafter's own copy; a DFlash drafter has none and reads the target's where it runs). A DFlash
        folder drops tensors SGLang ignores (a published drafter's extras), as SGLang does."""
        if self.family == DFLASH_KIND:
            return dflash_export.load(self.path, self._dtype(), allow_extra=True).train()
        if self.kind not in LAYOUTS:
            raise ValueError(
                f"{self.where}: {self.path} holds a {self.kind} drafter; the layouts loaded here: {', '.join(LAYOUTS)}"
            )
        return load_drafter(self.path, embedding, self.config)

    def _dtype(self) -> torch.dtype:
        from safetensors import safe_open

        with safe_open(str(self.path / dflash_export.WEIGHTS), framework="pt") as f:
            first = next(iter(f.keys()), None)
            return f.get_tensor(first).dtype if first else torch.float32

    def load_like(self, embedding: torch.Tensor, device: torch.device | str | None = None) -> torch.nn.Module:
        """The drafter for inference beside a target: the embedding's dtype, on `device` (default the embedding's)."""
        model = self.load(embedding.float())
        return model.to(device=device or embedding.device, dtype=embedding.dtype).eval()

    def on_target(self, model) -> tuple[torch.nn.Module, list[int]]:
        """(the drafter beside a loaded transformers target: its embedding, device and dtype; its aux layer ids,
        checked against the target's dimensions)."""
        c, emb = model.config, model.get_input_embeddings().weight.detach()
        if self.family == DFLASH_KIND:
            self.config.check_target(c.hidden_size, c.vocab_size, c.num_hidden_layers)
            return self.load_like(emb), list(self.config.target_layer_ids)
        aux_ids = self.config.check_target(c.hidden_size, c.vocab_size, c.num_hidden_layers)
        return self.load_like(emb), aux_ids
