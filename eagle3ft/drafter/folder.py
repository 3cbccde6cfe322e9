"""A drafter folder in SGLang's form (config.json + *.safetensors): the one place that opens one.

`DrafterFolder(path, where)` reads config.json once; `.check(target, features)` is the one check before any compute
(the config against the target or the feature store, the draft vocabulary, finite weights, the weights' shapes);
`.load(embedding)` builds the model from the config already read. Train's warm start, held-out τ, the offline eval,
the comparison, the demo and the bench all open their drafters here.

`kind` is config.json's architectures[0]: the layout, and so the model class and the loader's key rules
(export.py's LAYOUTS). A kind that model.py cannot build is still read and checked against a target (SGLang may
serve it); `load` refuses it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3ft.drafter.config import DrafterConfig, check_drafter
from eagle3ft.drafter.export import CONFIG, LAYOUTS, check_weight_shapes, load_drafter
from eagle3ft.drafter.vocab import check_vocab, vocab_from_drafter
from eagle3ft.files import check_finite_file
from eagle3ft.run_dir import RunDir


class DrafterFolder:
    """One drafter folder: `config` (its DrafterConfig, read once), `path`, `where` (the option that named it, in
    every message)."""

    def __init__(self, path: str | Path, where: str = "drafter"):
        self.path, self.where = Path(path), where
        if not (self.path / CONFIG).is_file():
            raise FileNotFoundError(f"{where}: {self.path} has no {CONFIG} (expected a drafter in SGLang's form)")
        self.config = DrafterConfig.from_json(self.path / CONFIG)

    @classmethod
    def of_run(cls, run_dir: str | Path, checkpoint: str, where: str = "eval.checkpoint") -> DrafterFolder:
        """The evaluated drafter of a run: `checkpoint` (eval.checkpoint) resolved against the run folder."""
        if not checkpoint:
            raise ValueError(f"{where}: name the drafter folder to evaluate")
        return cls(RunDir(run_dir).drafter(checkpoint), where)

    @property
    def kind(self) -> str:
        """The layout: config.json's architectures[0]."""
        return self.config.architecture

    def __repr__(self) -> str:
        return f"DrafterFolder({str(self.path)!r}, kind={self.kind!r})"

    def check(self, target: dict | None = None, features: str | None = None) -> DrafterFolder:
        """The one check before any compute; returns self. With `target` (hidden_size, vocab_size, num_layers, and
        aux_layer_ids when it is a feature store's identity, `features` its manifest), check_drafter against it and
        the draft vocabulary in range; without, the draft vocabulary against the folder's own sizes. Then every
        weight finite (NonFinite) and of the shape config.json gives it."""
        name = f"{self.where} {self.path}"
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

    def check_finite(self) -> None:
        """NonFinite naming the file and tensor when a weight holds a NaN or inf: such a drafter drafts nothing
        (τ 1.0) and its numbers would look like a result. Reads one tensor at a time."""
        for f in sorted(self.path.glob("*.safetensors")):
            check_finite_file(f, f"{self.where}: the drafter's weights")

    def load(self, embedding: torch.Tensor | None = None) -> torch.nn.Module:
        """The drafter in its weights' dtype, in training mode; `embedding` (V, H) is the target's input embedding."""
        if self.kind not in LAYOUTS:
            raise ValueError(
                f"{self.where}: {self.path} holds a {self.kind} drafter; the layouts loaded here: {', '.join(LAYOUTS)}"
            )
        return load_drafter(self.path, embedding, self.config)

    def load_like(self, embedding: torch.Tensor, device: torch.device | str | None = None) -> torch.nn.Module:
        """The drafter for inference beside a target: the embedding's dtype, on `device` (default the embedding's)."""
        model = self.load(embedding.float())
        return model.to(device=device or embedding.device, dtype=embedding.dtype).eval()

    def on_target(self, model) -> tuple[torch.nn.Module, list[int]]:
        """(the drafter beside a loaded transformers target: its embedding, device and dtype; its aux layer ids,
        checked against the target's dimensions)."""
        c, emb = model.config, model.get_input_embeddings().weight.detach()
        aux_ids = self.config.check_target(c.hidden_size, c.vocab_size, c.num_hidden_layers)
        return self.load_like(emb), aux_ids
