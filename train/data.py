"""Training batches: from the feature store or from the target itself, padded or packed.

Features (`train.features`):
- offline: the samples of RUN/features, each with its stored aux states and top-k.
- online: token samples (RUN/tokens from data/tokens.py, and the train splits of `train.more_tokens`' stores; else
  the token ids of RUN/features). The target runs beside the drafter on each rank's own micro-batch: one prefill of
  its samples through the harvest's capture (eagle3ft/targets/hf.py: forward hooks at the aux layers, the top-k head
  of eagle3ft/targets/head.py), under no grad, in bf16 on CUDA and fp32 on the CPU. The batch then holds exactly what
  the store would. Nothing is written.

Loops (`train.loop_weight` < 1): `LoopWeighted` (train/batching.py) weights the answers' repetition-loop tokens
(data/loops.py), or at 0 cuts them from loss_mask, after the subset and the vocabulary are drawn (so both stay as at
weight 1).

Layout (`train.pack_tokens`; the order, bins and packed rows in train/batching.py):
- None: `micro_batch_size` samples per micro-batch in the seeded epoch order, right-padded (data/store.py collate).
- N: whole samples (truncated to min(max_len, N)) packed into bins of at most N tokens by first-fit decreasing
  over the seeded epoch order, the bins then in a seeded order. One bin is one micro-batch (1, N): its samples
  back to back, then padding; `position_ids` restart at 0 per sample, which train/ttt.py turns into
  document-causal attention and targets that stay in their sample. The bins depend only on the seed, the epoch
  and the sample lengths, so every rank computes the same bins and takes its own (batch r, r+W, ...), and the
  data position of a checkpoint (epoch, micro-batch) resumes exactly.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterator

import torch

from eagle3ft.config import Config, DrafterSection, HarvestConfig, TargetConfig, resolve_path
from eagle3ft.data.prompts import source_name
from eagle3ft.data.sources import sample_sources
from eagle3ft.data.store import MANIFEST, FeatureStore, StoreError, collate, dequantize_aux, quantize_aux
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.vocab import build_vocab, load_vocab, save_vocab
from eagle3ft.run_dir import RunDir
from eagle3ft.train.batching import EpochOrder, LoopWeighted, collate_packed, epoch_order, pack_bins, sample_spans
from eagle3ft.train.guard import validation_indices
from eagle3ft.train.metrics import elapsed, timestamp

TOKEN_KEYS = ("input_ids", "loss_mask")


# --------------------------------------------------------------------------- online features


class OnlineTarget:
    """The target beside the drafter: a prefill of each micro-batch's samples gives the feature store's keys."""

    def __init__(self, target: TargetConfig, drafter: DrafterSection, harvest: HarvestConfig) -> None:
        from eagle3ft.targets.base import Sampling
        from eagle3ft.targets.hf import HFTarget, load_target

        dtype = target.dtype if target.dtype != "auto" else ("bfloat16" if torch.cuda.is_available() else "float32")
        self.cfg = dataclasses.replace(target, device="cpu", dtype=dtype)  # moved to the rank's device by `to`
        model, tokenizer = load_target(self.cfg)
        c = model.config
        spec = DrafterConfig.from_json(resolve_path(drafter.config), drafter.draft_vocab_size)
        self.aux_layer_ids = spec.check_target(c.hidden_size, c.vocab_size, c.num_hidden_layers)
        self.target = HFTarget(self.cfg, self.aux_layer_ids, model=model, tokenizer=tokenizer)
        self.sampling = Sampling(topk=harvest.topk, last_hidden=harvest.store_last_hidden)
        self.aux_fp8 = harvest.aux_dtype == "fp8"  # the aux states as an fp8 store would give them back
        self.spans: list = []  # per prefill: (start, end) timestamps (train/metrics.py), read by take_seconds
        info = self.target.info
        self.identity = {
            "name": info.name,
            "hidden_size": info.hidden_size,
            "vocab_size": info.vocab_size,
            "num_layers": info.num_layers,
            "aux_layer_ids": list(info.aux_layer_ids),
        }

    def to(self, device: torch.device) -> "OnlineTarget":
        from eagle3ft.targets.hf import HFTarget

        t = self.target
        self.target = HFTarget(self.cfg, self.aux_layer_ids, model=t.model.to(device), tokenizer=t.tokenizer)
        return self

    def features(self, batch: dict, device: torch.device) -> dict[str, torch.Tensor]:
        """aux_hidden, topk_ids, topk_logprobs (and last_hidden) for a collated token batch, laid
        out as the batch is, on `device`: zeros on padding, as the store's collate leaves them."""
        B, T = batch["input_ids"].shape
        spans = sample_spans(batch)
        flat_ids = batch["input_ids"].reshape(-1).tolist()
        start = timestamp(device.type == "cuda")
        feats = self.target.capture([flat_ids[a : a + n] for a, n in spans], self.sampling, to_host=False)
        rows = torch.cat([torch.arange(a, a + n) for a, n in spans]).to(device)  # (N,) the real rows of (B*T)
        out = {}
        for key, dtype in (
            ("aux_hidden", None),
            ("topk_ids", torch.long),
            ("topk_logprobs", None),
            ("last_hidden", None),
        ):
            parts = [getattr(f, key) for f in feats]
            if parts[0] is None:
                continue
            real = torch.cat(parts).to(device=device, dtype=dtype)  # (N, ...) outside inference mode: a plain tensor
            if key == "aux_hidden" and self.aux_fp8:  # what data/store.py writes and reads back for aux_dtype fp8
                real = dequantize_aux(*quantize_aux(real.to(torch.bfloat16), self.identity["hidden_size"]))
            out[key] = real.new_zeros((B * T, *real.shape[1:])).index_copy_(0, rows, real).view(B, T, *real.shape[1:])
        self.spans.append((start, timestamp(device.type == "cuda")))
        return out

    def take_seconds(self) -> float:
        """Seconds spent in the prefills since the last call (CUDA: measured by events on the GPU's timeline)."""
        spans, self.spans = self.spans, []
        return sum(elapsed(a, b) for a, b in spans)


# --------------------------------------------------------------------------- the loop's batches


@dataclass
class MicroBatch:
    tensors: dict[str, torch.Tensor]  # on the training device: what TTTObjective.forward takes
    sample_ids: list[int]
    tokens: int  # real tokens (padding excluded)


def token_dataset(
    run_dir: Path,
    store: FeatureStore | None,
    split: str = "train",
    more: tuple[str, ...] = (),
    drop: tuple[str, ...] = (),
):
    """(RUN/tokens' split, else the token ids of the feature store's; where it is; each sample's source name, None
    where the store recorded none) for online training. The train split also takes the samples of the token stores
    `more` (train.more_tokens), which must have RUN/tokens' identity (target, tokenizer, chat template), and leaves
    out the samples of the sources `drop` (train.drop_sources)."""
    from eagle3ft.data.tokens import TokenDataset, TokenStore

    tokens = RunDir(run_dir).tokens
    if (tokens / MANIFEST).is_file():
        first = TokenStore(tokens)
        others = [TokenStore(resolve_path(p)) for p in more] if split == "train" else []
        for other in others:
            if other.identity != first.identity:
                raise StoreError(
                    f"train.more_tokens: {other.dir} was regenerated with another target, tokenizer or chat template "
                    f"than {tokens} ({other.identity} != {first.identity})"
                )
        shards = first.shards(split) + [f for other in others for f in other.shards(split)]
        dataset = TokenDataset(shards)
        names = [n for st in [first, *others] for n in st.sources(split)]
        if drop and split == "train":
            keep = [i for i, n in enumerate(names) if n not in drop]
            dataset, names = dataset.subset(keep), [names[i] for i in keep]
        return dataset, " + ".join(str(s.dir) for s in [first, *others]), names
    if drop:
        raise StoreError(f"train.drop_sources needs a token store at {tokens} (it records each sample's source)")
    if more:
        raise StoreError(f"train.more_tokens needs a token store at {tokens} to train beside")
    if store is not None:
        return store.dataset(split, keys=TOKEN_KEYS), str(store.dir), store.sources(split)
    raise StoreError(
        f"train.features is online but {run_dir} has neither a token store (tokens/) nor a feature store (features/)"
    )


def shards_fingerprint(shards: list[Path]) -> str:
    """sha256 over the (file name, sha256) that each shard's store manifest records: the identity of the samples a
    run trains on, the same for every read of one store and different after a re-harvest (train/run_state.py)."""
    import hashlib
    import json

    manifests: dict[Path, dict] = {}
    entries = []
    for shard in shards:
        folder = Path(shard).parent
        if folder not in manifests:
            manifest = json.loads((folder / MANIFEST).read_text())
            manifests[folder] = {s["file"]: s.get("sha256") for s in manifest["shards"]}
        entries.append([Path(shard).name, manifests[folder].get(Path(shard).name)])
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def answer_subset(dataset, per_sample: list[int], limit: int, seed: int):
    """(the samples of a fixed seeded order, taken until their answer tokens reach `limit`, in store order; their
    answer tokens). The order depends on the seed alone, so the subsets of two limits are nested."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed * 7_919 + 104_729)).tolist()
    keep, total = [], 0
    for i in order:
        if total >= limit:
            break
        keep.append(i)
        total += per_sample[i]
    return dataset.subset(sorted(keep)), total


def answer_token_counts(dataset, vocab_size: int) -> torch.Tensor:
    """(V,) int64: the loss-masked tokens of a feature or token dataset's samples, their ids and masks read alone."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i in range(len(dataset)):
        rows, _ = dataset.rows(i, ["input_ids", "loss_mask"])
        counts += torch.bincount(rows["input_ids"].long()[rows["loss_mask"].bool()], minlength=vocab_size)
    return counts


def ensure_vocab(drafter: DrafterSection, run_dir: Path, dataset, where: str) -> None:
    """Online training's draft vocabulary: the top loss-masked tokens of the samples it trains on.

    RUN/vocab.safetensors is (re)written when it is missing or differs, e.g. when a harvest of held-out
    prompts alone wrote one from an empty train split. A warm start keeps the drafter's own vocab.
    """
    if drafter.init:
        return
    spec = DrafterConfig.from_json(resolve_path(drafter.config), drafter.draft_vocab_size)
    d2t, t2d = build_vocab(answer_token_counts(dataset, spec.vocab_size), spec.draft_vocab_size)
    path = RunDir(run_dir).vocab
    if path.is_file():
        old_d2t, old_t2d = load_vocab(path)
        if old_d2t.shape == d2t.shape and torch.equal(old_d2t, d2t) and torch.equal(old_t2d, t2d):
            return
    save_vocab(path, d2t, t2d, f".{path.name}.{os.getpid()}.tmp")  # every rank writes the same bytes
    if os.environ.get("RANK", "0") == "0":
        print(
            f"wrote {path}: the {spec.draft_vocab_size} most frequent loss-masked tokens of {where} (online training)",
            flush=True,
        )


def weighted(harvest: HarvestConfig) -> bool:
    """Whether a source of harvest.sources weighs other than 1 in training."""
    return any(s.weight != 1 for s in harvest.sources)


def source_weights(
    harvest: HarvestConfig, names: list[str | None], answer_tokens: list[int], where: str
) -> tuple[list[float] | None, dict]:
    """(each training sample's weight, None when every source weighs 1; per source: samples, answer tokens, weight
    and its share of the answer tokens an epoch draws). A sample weighs as the source of harvest.sources it was
    recorded under (data/prompts.py source_name); one of no source there weighs 1. A source that weighs other than 1
    must have samples, or its weight would be silently lost."""
    weight_of = {source_name(s): s.weight for s in harvest.sources}
    mix: dict[str, dict] = {}
    for name, n in zip(names, answer_tokens):
        m = mix.setdefault(name or "unrecorded", {"samples": 0, "answer_tokens": 0, "weight": weight_of.get(name, 1.0)})
        m["samples"] += 1
        m["answer_tokens"] += n
    drawn = sum(m["answer_tokens"] * m["weight"] for m in mix.values())
    for m in mix.values():
        m["share"] = m["answer_tokens"] * m["weight"] / drawn if drawn > 0 else 0.0
    if not weighted(harvest):
        return None, mix
    lost = [n for n, w in weight_of.items() if w != 1 and n not in mix]
    if lost:
        raise StoreError(
            f"{where}: harvest.sources give {', '.join(lost)} a weight, but no training sample is recorded under "
            f"{'that name' if len(lost) == 1 else 'those names'} (sources recorded: {', '.join(sorted(mix))})"
        )
    if drawn <= 0:
        raise StoreError(f"{where}: every training sample's source weighs 0 (harvest.sources weight)")
    return [weight_of.get(n, 1.0) for n in names], mix


class TrainData:
    """The training split and how it becomes micro-batches: offline or online, padded or packed, each source drawn as
    often as its weight says (epoch_order)."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        tcfg = cfg.train
        if tcfg.data.features not in ("offline", "online"):
            raise ValueError(f"train.features '{tcfg.data.features}' is not one of offline, online")
        if tcfg.data.drop_sources and tcfg.data.features != "online":
            raise ValueError("train.drop_sources is read by online training only (train.features: online)")
        if tcfg.data.more_tokens and tcfg.data.features != "online":
            raise ValueError("train.more_tokens is read by online training only (train.features: online)")
        self.cfg, self.online, self._bins, self._orders = cfg, None, {}, {}
        features = RunDir(run_dir).features
        self.store = (
            FeatureStore(features) if tcfg.data.features == "offline" or (features / MANIFEST).is_file() else None
        )  # also the held-out split
        if tcfg.data.features == "offline":
            self.dataset, self.where = self.store.dataset("train"), str(self.store.dir)
            self.target, self.has_last_hidden = self.store.target, self.store.manifest.get("has_last_hidden", False)
            if weighted(cfg.harvest):  # a store harvested before the sources were recorded: found from the sample ids
                names = sample_sources(self.store, cfg.harvest, "train")
            else:
                names = self.store.sources("train")
        else:
            self.dataset, self.where, names = token_dataset(
                run_dir, self.store, more=tuple(tcfg.data.more_tokens), drop=tuple(tcfg.data.drop_sources)
            )
        if len(self.dataset) == 0:
            raise StoreError(f"{self.where}: no training samples (the train split is empty)")
        self.fingerprint = shards_fingerprint(self.dataset.shards)  # recorded in each checkpoint
        # train.guard: its validation splits leave the training samples before anything is drawn from them
        drawn = validation_indices(tcfg.guard, names, cfg.seed)
        self.validation = {k: self.dataset.subset(idx) for k, idx in drawn.items()}
        if drawn:
            taken = {i for idx in drawn.values() for i in idx}
            keep = [i for i in range(len(self.dataset)) if i not in taken]
            self.dataset, names = self.dataset.subset(keep), [names[i] for i in keep]
        per_sample = self.dataset.loss_tokens()
        self.answer_tokens = self.all_answer_tokens = sum(per_sample)
        of_row = dict(zip(self.dataset.index, zip(names, per_sample)))  # a sample's place in its shard -> both
        if tcfg.data.max_answer_tokens is not None:
            self.dataset, self.answer_tokens = answer_subset(
                self.dataset, per_sample, tcfg.data.max_answer_tokens, cfg.seed
            )
        kept = [of_row[row] for row in self.dataset.index]
        self.sources = [name for name, _ in kept]  # per training sample, its source (None where none is recorded)
        self.weights, self.mix = source_weights(cfg.harvest, self.sources, [n for _, n in kept], self.where)
        if tcfg.data.features == "online":
            ensure_vocab(cfg.drafter, run_dir, self.dataset, self.where)
            self.online = OnlineTarget(cfg.target, cfg.drafter, cfg.harvest)
            self.target, self.has_last_hidden = self.online.identity, cfg.harvest.store_last_hidden
        self.counted = self.dataset  # the samples trained on, before any weighting wraps them
        self.loop_tokens = None  # answer tokens that train.loop_weight weights (None: every token weighs 1)
        if tcfg.objective.loop_weight < 1:  # after the subset and the vocab, so that they do not depend on it
            self.dataset = LoopWeighted(self.dataset, tcfg.objective.loop_weight)
            self.loop_tokens = self.dataset.loop_tokens
        self.run_dir = run_dir
        self.cap = min(tcfg.batch.max_len, tcfg.batch.pack_tokens or tcfg.batch.max_len)  # tokens kept per sample
        self.lengths = [min(n, self.cap) for n in self.dataset.lengths()] if tcfg.batch.pack_tokens else None

    def __len__(self) -> int:
        return len(self.dataset)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """(V,) the loss-masked tokens of the samples trained on (a warm start's grown draft vocab picks from them)."""
        return answer_token_counts(self.counted, vocab_size)

    def heldout(self, device: torch.device):
        """(held-out items, where they are, features, each item's source name): the feature store's held-out split
        offline (features None); online, the held-out token samples and the function that adds the target's features
        to a collated batch. The names are those the store recorded; train.best_on also finds them from the sample
        ids in a feature store written before they were recorded (data/sources.py sample_sources)."""
        if self.online is None:
            if self.store is None:
                return [], str(RunDir(self.run_dir).features), None, []
            names = self.store.sources("heldout")
            if self.cfg.train.heldout.best_on and None in names:
                names = sample_sources(self.store, self.cfg.harvest, "heldout")
            return self.store.dataset("heldout"), str(RunDir(self.run_dir).features), None, names
        ds, where, names = token_dataset(self.run_dir, self.store, "heldout")

        def features(batch: dict) -> dict:
            if self.online.target.device != device:
                self.online.to(device)
            return {**batch, **self.online.features(batch, device)}

        return ds, where, features, names

    def order(self, epoch: int) -> list[int]:
        """The epoch's draws of sample indices (epoch_order, weighted by the sources' weights)."""
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(len(self.dataset), self.cfg.seed, epoch, self.weights)}
        return self._orders[epoch]

    def bins(self, epoch: int) -> list[list[int]]:
        if epoch not in self._bins:
            tcfg = self.cfg.train
            self._bins = {
                epoch: pack_bins(self.lengths, tcfg.batch.pack_tokens, self.cfg.seed, epoch, self.order(epoch))
            }
        return self._bins[epoch]

    @property
    def per_micro_batch(self) -> int:
        """Entries of the epoch's order per micro-batch: samples, or one bin when packed."""
        return 1 if self.lengths is not None else self.cfg.train.batch.micro_batch_size

    def order_len(self, epoch: int) -> int:
        """Entries in the epoch's order: samples, or bins when packed (the data position counts these)."""
        return len(self.bins(epoch)) if self.lengths is not None else len(self.order(epoch))

    def micro_batches(self, epoch: int) -> int:
        """Micro-batches of one epoch over all ranks."""
        return math.ceil(self.order_len(epoch) / self.per_micro_batch)

    def loader(self, epoch: int) -> torch.utils.data.DataLoader:
        tcfg = self.cfg.train
        cuda = torch.cuda.is_available()
        workers = tcfg.data.num_workers if tcfg.data.num_workers is not None else (2 if cuda else 0)
        # its own generator: an iterator draws its workers' base seed from it, not from the global RNG (which the
        # checkpoints save and restore, so a resumed run must draw from it exactly as a straight one)
        generator = torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch + 104_729)
        common = dict(num_workers=workers, pin_memory=cuda, generator=generator)
        if self.lengths is not None:
            return torch.utils.data.DataLoader(
                self.dataset,
                batch_sampler=self.bins(epoch),
                collate_fn=partial(collate_packed, budget=tcfg.batch.pack_tokens, cap=self.cap),
                **common,
            )
        return torch.utils.data.DataLoader(
            EpochOrder(self.dataset, self.order(epoch)),
            batch_size=tcfg.batch.micro_batch_size,
            shuffle=False,
            collate_fn=partial(collate, max_len=tcfg.batch.max_len),
            **common,
        )

    def epoch(self, dist, epoch: int, skip: int = 0) -> Iterator[MicroBatch]:
        """This rank's micro-batches of `epoch` on its device, after the first `skip` (resume)."""
        if self.online is not None and self.online.target.device != dist.device:
            self.online.to(dist.device)
        for batch in dist.prepare_loader(self.loader(epoch), skip_batches=skip):
            sample_ids = batch.pop("sample_id").tolist()
            tokens = int(batch["attention_mask"].sum())
            extra = self.online.features(batch, dist.device) if self.online is not None else {}
            tensors = {k: v.to(dist.device, non_blocking=True) for k, v in batch.items()}
            yield MicroBatch({**tensors, **extra}, sample_ids, tokens)
