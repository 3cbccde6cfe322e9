"""The trainer's config section (`train:`), its fields grouped by concern.

A file, `--set` and the code write the same path: `train.optimizer.lr`, `cfg.train.optimizer.lr`. The flat spelling
of earlier configs (`train.lr`) is still read, as an alias, with a one-line notice (eagle3ft/config_build.py); field
names are unique across the groups, which is what lets each flat name stand for one field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from eagle3ft.config_build import BoundError, at_most, non_negative, positive


@dataclass
class ObjectiveConfig:
    """What the drafter is trained to match: the TTT unroll and its loss (train/ttt.py, train/losses.py)."""

    ttt_steps: int = 7
    step_decay: float = 0.8  # the loss weight of unroll step k is step_decay**k
    # ce | tv (1 - Σ min(p, q)) | lk (-log Σ min(p, q)) | lk_hybrid (exp(-η·α)·KL + (1 - exp(-η·α))·TV)
    loss: Literal["ce", "tv", "lk", "lk_hybrid"] = "ce"
    lk_eta: float = 3.0  # η of lk_hybrid
    target_source: Literal["auto", "topk", "last_hidden"] = "auto"  # auto: last_hidden when stored, else top-k
    # the loss weight of the answers' loop tokens (data/loops.py: runs of >= 8 tokens whose 8-gram occurred earlier
    # in the same answer): 1 as every token, 0 cut (loss_mask 0), between a weighted mean over the positions
    loop_weight: float = 1.0
    # L2-SP: λ of the penalty λ·Σ‖w − w0‖² over every trained tensor, w0 the weights the run started from (the warm
    # start's); 0 = off; auto: set by the run itself after its first steps when it warm-starts (drafter.init), off
    # from scratch (train/l2sp.py `self_set_lambda`; the value and its reason go to RUN/train/l2sp.json)
    l2sp: float | Literal["auto"] = 0.0
    # a DFlash drafter's block objective (train/dflash_loss.py; the TTT keys above are EAGLE-3's): blocks sampled per
    # sequence each step among the supervised anchors, and the position weight exp(-(k - 1) / dflash_gamma).
    # 512 x 16 positions x the target vocabulary of logits per sequence is large: the cross-entropy runs in chunks
    # of dflash_ce_chunk positions, each recomputed in the backward pass, so only one chunk's logits are held
    dflash_num_anchors: int = 512
    dflash_gamma: float = 7.0
    dflash_ce_chunk: int = 2048
    # B, the block size trained; None: the drafter config's block_size (what SGLang serves unless told otherwise)
    dflash_block_size: int | None = None

    def __post_init__(self) -> None:
        positive(self, "ttt_steps", "step_decay", "lk_eta")
        positive(self, "dflash_num_anchors", "dflash_gamma", "dflash_ce_chunk", "dflash_block_size")
        non_negative(self, "loop_weight")
        at_most(self, 1, "loop_weight")
        if self.l2sp == "auto":
            return
        # Adam moves each weight by about lr a step, so after one step the pull 2λ(w − w0) is about 2λ·lr per weight
        # against the loss's gradient (below 1 per weight): at λ 1e4 and the default lr 1e-4 the pull is already 2,
        # and above it the data no longer moves the drafter (near 1e30 Adam's fp32 moments overflow and it never moves)
        non_negative(self, "l2sp")
        at_most(self, 1e4, "l2sp")


@dataclass
class OptimizerConfig:
    """AdamW and gradient clipping."""

    lr: float = 1e-4  # the peak rate, reached after warm-up
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5  # 0: no clipping

    def __post_init__(self) -> None:
        positive(self, "lr")
        non_negative(self, "weight_decay", "max_grad_norm")
        # Adam moves each weight by about lr a step: no drafter trains above 10, and near 1e38 fp32 overflows
        at_most(self, 10, "lr")


@dataclass
class ScheduleConfig:
    """How long the run is, and the learning rate over it: linear warm-up, then cosine down to min_lr_ratio·lr."""

    warmup_steps: int = 20  # 0: none
    min_lr_ratio: float = 0.1  # 1: no decay
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; None = epochs over the train split
    # end this invocation after this many optimizer steps (a job time limit); resume continues
    stop_after: int | None = None

    def __post_init__(self) -> None:
        positive(self, "epochs", "max_steps", "stop_after")
        non_negative(self, "warmup_steps", "min_lr_ratio")
        at_most(self, 1, "min_lr_ratio")


@dataclass
class BatchConfig:
    """What one optimizer step sees: micro-batches per process, accumulated."""

    micro_batch_size: int = 1
    grad_accum: int = 1  # micro-batches per optimizer step, per process
    max_len: int = 2048  # tokens per sample (longer samples are truncated)
    # pack whole samples into micro-batches of this many tokens (micro_batch_size is then unused); None: pad
    pack_tokens: int | None = None

    def __post_init__(self) -> None:
        positive(self, "micro_batch_size", "grad_accum", "max_len", "pack_tokens")


@dataclass
class TrainDataConfig:
    """Where the training samples come from and which of them are used (train/data.py)."""

    # offline: RUN/features | online: the target's prefill per batch on RUN/tokens (else the features' tokens)
    features: Literal["offline", "online"] = "offline"
    # online: more token stores (tokens/ folders of data/regen.py runs of the same target and chat template, e.g. a
    # sampled second pass over the same prompts) whose train splits are trained on after RUN/tokens'
    more_tokens: list[str] = field(default_factory=list)
    drop_sources: list[str] = field(default_factory=list)  # online: leave out these sources' samples (their names)
    # train on a seeded subset of the train split: whole samples in a fixed random order (the same for every limit,
    # so smaller subsets lie inside larger ones) until their answer (loss-masked) tokens reach this; None: all of it
    max_answer_tokens: int | None = None
    num_workers: int | None = None  # DataLoader workers; None: 2 on CUDA (loading overlaps the step), 0 on the CPU

    def __post_init__(self) -> None:
        positive(self, "max_answer_tokens")
        non_negative(self, "num_workers")


@dataclass
class CheckpointConfig:
    """RUN/ckpt/step-N: how often, how many kept, where a run continues from (train/checkpoint.py)."""

    save_every: int = 200  # optimizer steps between checkpoints (and one at the end)
    keep_checkpoints: int = 2  # 0: every checkpoint kept
    resume: str | None = None  # None | auto | a ckpt/step-N folder

    def __post_init__(self) -> None:
        positive(self, "save_every")
        non_negative(self, "keep_checkpoints")


@dataclass
class HeldoutConfig:
    """Held-out τ during training, and the best checkpoint it chooses (train/validate.py)."""

    # held-out greedy chain τ (depth eval.steps) every this many optimizer steps and at the end; 0 = at the end only
    eval_every: int = 200
    eval_samples: int = 256  # the first this many samples of each held-out set form it
    # the held-out sets (source names: SourceConfig.name, else the kind, file:PATH) whose τ, weighted so, choose
    # RUN/export-best; empty: every held-out sample as one set
    best_on: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        positive(self, "eval_samples")
        non_negative(self, "eval_every")
        if any(w < 0 for w in self.best_on.values()) or (self.best_on and not sum(self.best_on.values()) > 0):
            raise BoundError(self, "best_on", f"must hold weights >= 0 with a positive sum, got {self.best_on}")


@dataclass
class GuardConfig:
    """The guard on what the drafter already knew (train/guard.py): validation splits drawn out of the training
    sources, never from a held-out set, and the export chosen on them. Off while general_from is null."""

    # the training source (its name in harvest.sources) whose seeded general_samples conversations form the general
    # validation split, e.g. the replay of general conversations; they are not trained on
    general_from: str | None = None
    general_samples: int = 8
    # the export is the best step on the domain among those whose general τ stays >= (1 - general_bound) x the
    # start's (the start itself is one of them); none better than the start: the start is exported, and says so
    general_bound: float = 0.01
    # the training source whose seeded domain_samples conversations form the domain's validation split, on which
    # the steps are ranked; null: train.heldout's score (best_on), which makes the held-out sets a choice's input
    domain_from: str | None = None
    domain_samples: int = 8

    def __post_init__(self) -> None:
        positive(self, "general_samples", "domain_samples")
        non_negative(self, "general_bound")
        at_most(self, 1, "general_bound")


@dataclass
class LoggingConfig:
    """RUN/train/metrics.jsonl and wandb (train/metrics.py)."""

    log_every: int = 1
    wandb_project: str = "eagle3ft"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"

    def __post_init__(self) -> None:
        positive(self, "log_every")


@dataclass
class EngineConfig:
    """How the step runs: DeepSpeed's ZeRO stage, precision, compilation (train/dist.py)."""

    deepspeed: str = "configs/deepspeed/zero2.json"  # ZeRO stage + precision; configs/deepspeed/zero3.json for stage 3
    precision: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU; fills the json's "auto"
    # torch.compile the drafter's norms, q/k/v + rope and MLP; None: on with CUDA (at K2 dims it computes what eager
    # does and its step is ~10% faster), off on the CPU (its compile takes longer than a short run)
    compile: bool | None = None


@dataclass
class TrainConfig:
    """train/finetune.py: TTT fine-tuning of the drafter under accelerate + DeepSpeed."""

    GROUPED: ClassVar[bool] = True  # each field a group; its keys also read flat under `train:` (config_build.py)

    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)  # train.ttt_steps, loss, l2sp, ...
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # train.lr, weight_decay, max_grad_norm
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)  # train.warmup_steps, max_steps, ...
    batch: BatchConfig = field(default_factory=BatchConfig)  # train.micro_batch_size, grad_accum, ...
    data: TrainDataConfig = field(default_factory=TrainDataConfig)  # train.features, more_tokens, ...
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # train.save_every, resume, ...
    heldout: HeldoutConfig = field(default_factory=HeldoutConfig)  # train.eval_every, best_on, ...
    guard: GuardConfig = field(default_factory=GuardConfig)  # train.general_from, general_bound, domain_from, ...
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # train.log_every, wandb_*
    engine: EngineConfig = field(default_factory=EngineConfig)  # train.deepspeed, precision, compile


MISSING = object()


def written_value(train: dict, path: str) -> Any:
    """The value of `path` ("optimizer.lr") in a written config's train section: grouped, or flat as configs were
    written before the groups (a checkpoint's trainer_state.json); MISSING when it holds neither."""
    group, key = path.split(".")
    if isinstance(train.get(group), dict) and key in train[group]:
        return train[group][key]
    return train.get(key, MISSING)
