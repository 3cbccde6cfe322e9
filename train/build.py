"""The drafter a run trains: built from scratch or warm-started, its vocab made the run's, the target head it needs.

`build_drafter` checks the drafter against the features' identity before any compute; `adopt_drafter_vocab`
makes a warm-start drafter's d2t/t2d the run folder's vocab.safetensors; `target_head` gives the target lm_head
rows of the draft vocab when the training targets come from last_hidden. train/loop.py's setup calls all three.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch

from eagle3ft.config import DrafterSection, TargetConfig, resolve_path
from eagle3ft.config_train import ObjectiveConfig
from eagle3ft.data.store import StoreError
from eagle3ft.drafter.config import DrafterConfig, capture_points, check_drafter
from eagle3ft.drafter.folder import DrafterFolder
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.drafter.model_mla import new_drafter
from eagle3ft.drafter.vocab import grow_vocab, load_vocab, save_vocab
from eagle3ft.run_dir import RunDir
from eagle3ft.train.data import TrainData


def build_drafter(
    drafter: DrafterSection,
    target_cfg: TargetConfig,
    run_dir: Path,
    target: dict,
    token_counts: Callable[[int], torch.Tensor] | None = None,
) -> Eagle3Drafter:
    """`_build_drafter`'s drafter, whose export names for vLLM the layers SGLang captures on this target."""
    from eagle3ft.targets.hf import target_architectures

    model = _build_drafter(drafter, target_cfg, run_dir, target, token_counts)
    spec = model.config
    if spec.aux_layer_ids is not None:
        spec.vllm_aux_layer_ids = capture_points(target_architectures(target_cfg), spec.aux_layer_ids)
    return model


def _build_drafter(
    drafter: DrafterSection,
    target_cfg: TargetConfig,
    run_dir: Path,
    target: dict,
    token_counts: Callable[[int], torch.Tensor] | None = None,
) -> Eagle3Drafter:
    """Scratch (architecture json + the run's vocab) or warm start (a drafter folder, its own d2t/t2d).

    `target` is the features' identity (`target_cfg` the config's target section); check_drafter refuses a drafter that disagrees with it before any compute.
    A warm start grows by drafter.num_hidden_layers and drafter.draft_vocab_size past the drafter's own; the added
    draft tokens are the most frequent answer tokens of `token_counts(vocab_size)` (TrainData.token_counts).
    """
    from eagle3ft.targets.hf import load_input_embedding

    features = str(RunDir(run_dir).features_manifest)
    if drafter.init:
        init = DrafterFolder(resolve_path(drafter.init), "warm start").check(target, features)
        folder, spec = init.path, init.config
        if (drafter.draft_vocab_size or spec.draft_vocab_size) < spec.draft_vocab_size:
            raise ValueError(
                f"drafter.draft_vocab_size {drafter.draft_vocab_size} < the warm-start drafter's "
                f"{spec.draft_vocab_size} (its vocab is kept, and can only grow)"
            )
        layout = spec.check_supported()
        for flag in ("fc_norm", "norm_output"):  # EAGLE-3.1 options change what the trained weights mean
            if getattr(drafter, flag) not in (None, getattr(layout, flag)):
                raise ValueError(
                    f"drafter.{flag} {getattr(drafter, flag)} != warm-start drafter's {getattr(layout, flag)} "
                    f"({folder}/config.json; its layout is kept)"
                )
        model = init.load(load_input_embedding(target_cfg)).float()
        model = grow_drafter(model, drafter.num_hidden_layers, folder)
        size = drafter.draft_vocab_size
        if size is None or size == model.config.draft_vocab_size:
            return model
        if token_counts is None:
            raise ValueError(f"growing {folder}'s draft vocab to {size} needs the training data's token counts")
        return grow_drafter_vocab(model, size, token_counts(model.config.vocab_size))
    keys = ("fc_norm", "norm_output", "num_hidden_layers")
    overrides = {k: getattr(drafter, k) for k in keys if getattr(drafter, k) is not None}
    if drafter.draft_vocab_size:
        overrides["draft_vocab_size"] = drafter.draft_vocab_size
    dcfg = dataclasses.replace(DrafterConfig.from_json(resolve_path(drafter.config)), **overrides)
    check_drafter(dcfg, target, str(drafter.config), features)
    vocab_file = RunDir(run_dir).vocab
    if not vocab_file.is_file():
        raise FileNotFoundError(
            f"{vocab_file} not found: the harvest writes it (python data/harvest.py ... --run-dir {run_dir})"
        )
    d2t, t2d = load_vocab(vocab_file)
    check_drafter(dcfg, target, str(vocab_file), features, d2t, t2d)
    model = new_drafter(dcfg)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(load_input_embedding(target_cfg))
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
    return model


def grow_drafter(model: Eagle3Drafter, layers: int | None, folder: Path) -> Eagle3Drafter:
    """`model` with `layers` decoder layers (None: as it is): the ones it lacks added on top, each starting as the
    identity, so the grown drafter's outputs equal the warm-start drafter's until training moves them."""
    have = model.config.num_hidden_layers
    if layers is None or layers == have:
        return model
    if layers < have:
        raise ValueError(f"drafter.num_hidden_layers {layers} < the warm-start drafter's {have} ({folder}/config.json)")
    grown = new_drafter(dataclasses.replace(model.config, num_hidden_layers=layers))
    missing, unexpected = grown.load_state_dict(model.state_dict(), strict=False)
    if unexpected or any(not k.startswith("layers.") for k in missing):
        raise ValueError(f"growing {folder} to {layers} layers: unexpected {unexpected}, unfilled {missing}")
    for i in range(have, layers):
        grown.layers[str(i)].start_as_identity()
    return grown.float()


def grow_drafter_vocab(model: Eagle3Drafter, size: int, token_counts: torch.Tensor) -> Eagle3Drafter:
    """`model` over a draft vocab of `size`: its own tokens (their lm_head rows kept) plus the most frequent others
    of `token_counts`, whose rows start at zero (logit 0) and train."""
    d2t, t2d, where = grow_vocab(model.d2t.cpu(), token_counts, size)
    grown = new_drafter(dataclasses.replace(model.config, draft_vocab_size=size))
    kept = {k: v for k, v in model.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    missing, unexpected = grown.load_state_dict(kept, strict=False)
    if unexpected or sorted(missing) != ["d2t", "lm_head.weight", "t2d"]:
        raise ValueError(f"growing the draft vocab to {size}: unexpected {unexpected}, unfilled {missing}")
    with torch.no_grad():
        grown.lm_head.weight.zero_()
        grown.lm_head.weight[where] = model.lm_head.weight.to(grown.lm_head.weight.dtype)
        grown.d2t.copy_(d2t)
        grown.t2d.copy_(t2d)
    return grown.float()


def adopt_drafter_vocab(run_dir: Path, d2t: torch.Tensor, t2d: torch.Tensor, folder: Path) -> str | None:
    """After a warm start the run's vocab.safetensors is the drafter's: rewrite it when it differs (or is
    missing or unreadable) and return what was done, so the run folder never holds two vocabularies."""
    vocab_file = RunDir(run_dir).vocab
    d2t, t2d = d2t.cpu().to(torch.int64), t2d.cpu().to(torch.bool)
    try:
        old = load_vocab(vocab_file) if vocab_file.is_file() else None
    except ValueError as e:
        old, why = None, f"was unreadable ({e})"
    else:
        why = "was missing"
    if old is not None:
        if old[0].shape == d2t.shape and old[1].shape == t2d.shape:
            n_d2t, n_t2d = int((old[0] != d2t).sum()), int((old[1] != t2d).sum())
            if n_d2t == 0 and n_t2d == 0:
                return None
            why = f"differed from it in {n_d2t} of {d2t.numel()} d2t and {n_t2d} of {t2d.numel()} t2d entries"
        else:
            why = f"had {old[0].numel()} draft tokens, the drafter {d2t.numel()}"
    save_vocab(vocab_file, d2t, t2d)
    return (
        f"{vocab_file} {why}; rewrote it with the warm-start drafter's d2t/t2d ({folder}), "
        "which its lm_head rows follow"
    )


def target_head(
    objective: ObjectiveConfig, target: TargetConfig, data: TrainData, model: Eagle3Drafter
) -> torch.Tensor | None:
    """The target lm_head rows of the draft vocab when p comes from last_hidden, else None."""
    source = objective.target_source
    if source not in ("auto", "topk", "last_hidden"):
        raise ValueError(f"train.target_source '{source}' is not one of auto, topk, last_hidden")
    has = data.has_last_hidden
    if source == "last_hidden" and not has:
        raise StoreError(
            f"train.target_source is last_hidden but {data.where} has no last_hidden (harvest.store_last_hidden)"
        )
    if source == "topk" or not has:
        return None
    from eagle3ft.targets.hf import load_output_head

    ids = torch.arange(model.config.draft_vocab_size) + model.d2t
    return load_output_head(target)[ids].float()
