"""A DFlash drafter as the trainer runs it: the block objective behind the engine's `forward(batch)`, and its build.

`DFlashObjective(drafter, embed, lm_head, ...)` holds the drafter and, frozen and unsaved, the target's input
embedding and LM head (as the EAGLE-3 path holds the target head: train/build.py). `forward(batch)` draws fresh
anchors (train/dflash_loss.sample_anchors) from a generator seeded by the run's seed and the batch's place in the run
(`batch["draw"]`: epoch, micro-batch of the epoch, rank; train/loop.py adds it), so a resumed run draws the same
anchors as an unbroken one; `forward(batch, steps=...)` is held-out τ: the live chain walk
(eagle3ft/drafter/dflash_walk.py) over every answer span, as chain counts per block position (`walk_counts`) that
train/validate.py's τ = 1 + Σ_k Π_j a_j turns back into the walk's mean of acc + 1 exactly.

The output has the TTT output's metric fields (train/metrics.py's Meter), one entry per block position 1..B-1:
`step_loss` the position's share of the loss (they sum to the loss), `correct`/`valid` per position, `chain_*` the
block chain's counts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3ft.config import Config, DrafterSection
from eagle3ft.config_train import ObjectiveConfig, TrainConfig
from eagle3ft.drafter.dflash_config import DFlashConfig
from eagle3ft.drafter.dflash_model import DFlashDrafter
from eagle3ft.drafter.dflash_walk import accepts, anchor_drafts, walk
from eagle3ft.drafter.folder import DFLASH_KIND, DrafterFolder
from eagle3ft.train.data import TrainData
from eagle3ft.train.dflash_loss import dflash_loss, sample_anchors


@dataclass
class DFlashOutput:
    loss: torch.Tensor
    step_loss: torch.Tensor  # (B - 1,) each block position's share of the loss
    correct: torch.Tensor  # (B - 1,)
    valid: torch.Tensor  # (B - 1,)
    chain_correct: torch.Tensor  # (B - 1,)
    chain_valid: torch.Tensor  # (B - 1,)


def answer_spans(loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a (T,) mask."""
    m = loss_mask.bool().tolist()
    spans, start = [], None
    for t, on in enumerate(m + [False]):
        if on and start is None:
            start = t
        elif not on and start is not None:
            spans.append((start, t))
            start = None
    return spans


def walk_counts(accepted: list[int], width: int) -> tuple[list[int], list[int]]:
    """Chain counts per block position k = 1..width of a walk's cycles: correct_k = cycles accepting >= k drafts,
    valid_k = correct_{k-1} (valid_1 = the cycles), so that 1 + Σ_k Π_{j<=k} correct_j / valid_j = the walk's τ."""
    correct = [sum(a >= k for a in accepted) for k in range(1, width + 1)]
    return correct, [len(accepted), *correct[:-1]]


class DFlashObjective(torch.nn.Module):
    """The drafter plus the block objective as one module, so that a distributed engine runs `forward(batch)`."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        num_anchors: int = 512,
        gamma: float = 7.0,
        seed: int = 0,
        ce_chunk: int | None = None,
    ) -> None:
        super().__init__()
        self.drafter, self.num_anchors, self.gamma, self.seed, self.ce_chunk = (
            drafter,
            num_anchors,
            gamma,
            seed,
            ce_chunk,
        )
        self.register_buffer("embed", embed.detach(), persistent=False)  # (V, h) the target's, frozen
        self.register_buffer("lm_head", lm_head.detach(), persistent=False)  # (V, h)

    def generator(self, batch: dict) -> torch.Generator:
        """Anchors' generator: the run's seed and the batch's place (epoch, micro-batch, rank) when given."""
        draw = batch.get("draw")
        place = [int(x) for x in draw.tolist()] if draw is not None else [0]
        g = torch.Generator()
        g.manual_seed(hash((self.seed, *place)) % 2**63)
        return g

    def forward(self, batch: dict[str, torch.Tensor], steps: int | None = None) -> DFlashOutput:
        """The block loss on fresh anchors; with `steps` (held-out τ) the chain walk's counts instead."""
        if steps is not None:
            return self.heldout(batch)
        tokens, mask = batch["input_ids"].long(), batch["loss_mask"]
        anchors = sample_anchors(mask, self.num_anchors, self.generator(batch))
        out = dflash_loss(
            self.drafter,
            batch["aux_hidden"],
            tokens,
            mask,
            self.embed,
            self.lm_head,
            anchors,
            self.gamma,
            self.ce_chunk,
        )
        share = out.loss.detach() * out.count / out.count.sum().clamp(min=1)  # the loss spread over the positions
        return DFlashOutput(out.loss, share, out.correct, out.count, out.chain_correct, out.chain_valid)

    @torch.no_grad()
    def heldout(self, batch: dict[str, torch.Tensor]) -> DFlashOutput:
        """The live chain walk over each answer span. train/validate.py's heldout_view has dropped the first token
        of every span (its root must be an answer token): a kept span [s, e) is the answer [s - 1, e), whose first
        token is the prefill's output (the first bonus) and whose last is the stop."""
        width = self.drafter.config.block_size - 1
        correct, valid = [0] * width, [0] * width
        dtype = next(self.drafter.parameters()).dtype  # the engine's (bf16 under DeepSpeed's bf16)
        embed, head = self.embed.to(dtype), self.lm_head.to(dtype)
        feats, tokens = batch["aux_hidden"].to(dtype), batch["input_ids"].long()
        for b in range(tokens.shape[0]):
            for s, e in answer_spans(batch["loss_mask"][b]):
                start, end = s - 1, e - 1  # the first bonus's position; the last generated token's
                if end <= start:
                    continue
                drafts = anchor_drafts(self.drafter, feats[b, :end], tokens[b, :end], start, embed, head)
                acc = accepts(drafts, tokens[b, :e], start)
                c, v = walk_counts(walk(acc, start, end).accepted, width)
                correct = [x + y for x, y in zip(correct, c)]
                valid = [x + y for x, y in zip(valid, v)]
        dev = tokens.device
        zero = torch.zeros(width, device=dev)
        c, v = torch.tensor(correct, dtype=torch.float, device=dev), torch.tensor(valid, dtype=torch.float, device=dev)
        return DFlashOutput(zero.sum(), zero, c, v, c, v)


def build_dflash(
    drafter: DrafterSection, objective: ObjectiveConfig, run_dir: Path, target: dict, spec: DFlashConfig
) -> DFlashDrafter:
    """Scratch (the architecture json) or warm start (a DFlash folder, extras SGLang ignores dropped), checked
    against the features' identity before any compute: the target's sizes, the captured layers and that the store
    was harvested for a DFlash drafter (its capture numbering)."""
    from eagle3ft.config import resolve_path
    from eagle3ft.run_dir import RunDir

    features = str(RunDir(run_dir).features_manifest)
    capture = (target.get("capture") or {}).get("kind", "eagle3")
    if capture != DFLASH_KIND:
        raise ValueError(
            f"{features}: the features were harvested for an {capture} drafter; a DFlash drafter needs its own "
            f"harvest (drafter.config {drafter.config} at harvest time)"
        )
    block = objective.dflash_block_size
    if drafter.init:
        folder = DrafterFolder(resolve_path(drafter.init), "warm start").require(DFLASH_KIND, "drafter.config")
        model = folder.check(target, features).load().float()
        if list(model.config.target_layer_ids) != list(spec.target_layer_ids):
            raise ValueError(
                f"warm start {folder.path}: target_layer_ids {model.config.target_layer_ids} != drafter.config's "
                f"{spec.target_layer_ids}"
            )
    else:
        spec.check_target(target["hidden_size"], target["vocab_size"], target["num_layers"])
        if list(target.get("aux_layer_ids", [])) != list(spec.target_layer_ids):
            raise ValueError(
                f"{drafter.config}: target_layer_ids {spec.target_layer_ids} != the features' captured layers "
                f"{target.get('aux_layer_ids')} ({features})"
            )
        model = DFlashDrafter(spec).float()
    if block is not None and block != model.config.block_size:
        model.config = dataclasses.replace(model.config, block_size=block)
    if model.config.mask_token_id is None:
        raise ValueError(f"{model.config.path}: training a DFlash drafter needs dflash_config.mask_token_id")
    return model


def check_dflash_run(train: TrainConfig) -> None:
    """What a DFlash run refuses before it loads anything (one line each): packed rows (a block would see another
    sample's features through the context) and online features (the online target captures EAGLE-3's layers)."""
    tcfg = train
    if tcfg.batch.pack_tokens:
        raise ValueError(
            "train.pack_tokens with a DFlash drafter: packed samples would share one context; leave it null"
        )
    if tcfg.data.features != "offline":
        raise ValueError(
            f"train.features {tcfg.data.features} with a DFlash drafter: train from a DFlash harvest (offline)"
        )


def dflash_objective(cfg: Config, run_dir: Path, data: TrainData, spec: DFlashConfig) -> DFlashObjective:
    """The drafter built or warm-started (build_dflash) and its objective over the target's frozen embedding and
    LM head."""
    from eagle3ft.targets.hf import load_input_embedding, load_output_head

    obj = cfg.train.objective
    model = build_dflash(cfg.drafter, obj, run_dir, data.target, spec)
    embed, head = load_input_embedding(cfg.target).float(), load_output_head(cfg.target).float()
    return DFlashObjective(model, embed, head, obj.dflash_num_anchors, obj.dflash_gamma, cfg.seed, obj.dflash_ce_chunk)
