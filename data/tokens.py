"""The token store: regenerated conversations as token ids, between regen and harvest/training.

``tokens/`` holds ``manifest.json`` and shards ``{split}-{NNNNN}.safetensors``
(NNNNN = the chunk of the deterministic conversation order that the shard holds).
Each shard concatenates its samples along the token axis:

    input_ids   int32  [N_tok]
    loss_mask   uint8  [N_tok]   1 on the tokens the target generated (end-of-turn included)
    offsets     int64  [N+1]     sample i = tokens offsets[i]:offsets[i+1]
    sample_ids  int64  [N]
    source_ids  int32  [N]       index into the shard's manifest entry ``sources`` (the names of
                                 harvest.sources, SourceConfig.name); a store written without it has no names

The manifest also counts samples, tokens and loss tokens per split and source (``source_counts``), so that
training can leave one source out (``train.drop_sources``). A shard is 5 bytes per token. Writes reuse the feature store's atomic commit
(data/store_writer.py: tmp file, fsync, os.replace, then the manifest), and a chunk is
recorded as done only with its shard, so a killed regeneration resumes at the
first chunk not done, with nothing lost or duplicated. A regeneration stopped early (data/regen.py) commits its
open chunks with conversations cut at their last answer and lists them in ``chunks_cut``: done all the same, a
rerun leaves them cut.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3ft.data.store import MANIFEST, SPLITS, ShardDataset, StoreError, check_shards, read_manifest, shard_sources
from eagle3ft.data.store_writer import open_manifest, write_shard
from eagle3ft.files import write_json

SCHEMA_VERSION = 1
KIND = "tokens"
COUNT_KEYS = ("samples", "tokens", "loss_tokens", "turns", "unfinished_answers")


@dataclass
class TokenSample:
    """One regenerated conversation."""

    sample_id: int
    input_ids: list[int]
    loss_mask: list[int]
    turns: int = 1  # assistant turns the target wrote
    unfinished: int = 0  # of them, answers cut by max_new_tokens / max_total_tokens
    source: str = ""  # the prompt source it came from (SourceConfig.name)


def pack(samples: list[TokenSample]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(the shard's tensors, the source names its source_ids index)."""
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int64)
    names = sorted({s.source for s in samples})
    return {
        "input_ids": torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.uint8),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        "sample_ids": torch.tensor([s.sample_id for s in samples], dtype=torch.int64),
        "source_ids": torch.tensor([names.index(s.source) for s in samples], dtype=torch.int32),
    }, names


def tokenizer_digest(tokenizer) -> str:
    """The vocabulary's identity (token -> id) that a store records, wherever the tokenizer was loaded from."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode()).hexdigest()


def check_tokenizer(tokens_dir: str | Path, tokenizer) -> None:
    """StoreError unless the store at `tokens_dir` was written with this tokenizer's vocabulary."""
    have = TokenStore(tokens_dir, verify=False).identity.get("tokenizer_sha256")
    if have != tokenizer_digest(tokenizer):
        raise StoreError(
            f"{tokens_dir}: the token store was made with another tokenizer (vocabulary sha256 {have} != "
            f"{tokenizer_digest(tokenizer)})"
        )


class TokenWriter:
    """Commits whole shards and keeps the manifest; reopening the same folder resumes.

    `identity` (target, tokenizer, chat template) and `fingerprint` (conversation order and
    sampling) must match an existing folder's manifest, or the writer refuses to mix runs.
    """

    def __init__(self, tokens_dir: str | Path, identity: dict, fingerprint: str):
        self.dir = Path(tokens_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        identity = {"schema_version": SCHEMA_VERSION, "kind": KIND, "identity": identity, "fingerprint": fingerprint}
        extra = {"source_counts": {s: {} for s in SPLITS}}
        self.manifest = open_manifest(self.dir, identity, COUNT_KEYS, "the token store", "tokens", extra=extra)

    def done(self, split: str) -> set[int]:
        return set(self.manifest["chunks_done"][split])

    def commit(
        self, split: str, chunk: int, samples: list[TokenSample], skips: dict[str, int] | None = None, cut: bool = False
    ) -> None:
        """Write one chunk's shard (if it kept any sample) and record the chunk as done; `cut`: a stopped
        regeneration committed it with conversations cut short (listed in ``chunks_cut``; done all the same)."""
        m = self.manifest
        if chunk in m["chunks_done"][split]:
            raise StoreError(f"chunk {split}/{chunk} is already committed")
        if samples:
            tensors, names = pack(samples)
            c = write_shard(self.dir, m, split, chunk, tensors, len(samples), SCHEMA_VERSION)
            m["shards"][-1]["sources"] = names
            self._count_sources(split, samples)
            c["turns"] += sum(s.turns for s in samples)
            c["unfinished_answers"] += sum(s.unfinished for s in samples)
        for reason, n in (skips or {}).items():
            m["chunk_skips"][reason] = m["chunk_skips"].get(reason, 0) + n
        m["chunks_done"][split].append(chunk)
        if cut:
            m.setdefault("chunks_cut", {s: [] for s in SPLITS})[split].append(chunk)
        self._save()

    def _count_sources(self, split: str, samples: list[TokenSample]) -> None:
        per = self.manifest.setdefault("source_counts", {s: {} for s in SPLITS})[split]
        for s in samples:
            c = per.setdefault(s.source, {"samples": 0, "tokens": 0, "loss_tokens": 0})
            c["samples"] += 1
            c["tokens"] += len(s.input_ids)
            c["loss_tokens"] += sum(s.loss_mask)

    def finish(self, extra: dict | None = None, complete: bool = True) -> None:
        """Record `extra`; `complete` once every chunk is done (a stopped regeneration leaves it False)."""
        self.manifest["complete"] = complete
        self.manifest.update(extra or {})
        self._save()

    def _save(self) -> None:
        self.manifest["shards"].sort(key=lambda s: (SPLITS.index(s["split"]), s["chunk"]))
        write_json(self.dir / MANIFEST, self.manifest)


class TokenStore:
    """Reader. Checks schema and checksums on open (verify=False skips the hashing)."""

    def __init__(self, tokens_dir: str | Path, verify: bool = True):
        self.dir = Path(tokens_dir)
        self.manifest = read_manifest(self.dir, "token store", SCHEMA_VERSION, kind=KIND)
        check_shards(self.dir, self.manifest.get("shards"), verify)

    @property
    def identity(self) -> dict:
        return self.manifest["identity"]

    @property
    def complete(self) -> bool:
        return bool(self.manifest["complete"])

    def counts(self, split: str) -> dict:
        return dict(self.manifest["counts"][split])

    def shards(self, split: str) -> list[Path]:
        return [self.dir / s["file"] for s in self.manifest["shards"] if s["split"] == split]

    def sources(self, split: str) -> list[str | None]:
        """The source name of each sample of `split`, in dataset order (None where the store recorded none)."""
        return shard_sources(self.dir, self.manifest, split)

    def dataset(self, split: str = "train") -> "TokenDataset":
        if split not in SPLITS:
            raise ValueError(f"split {split!r} not in {SPLITS}")
        return TokenDataset(self.shards(split))


class TokenDataset(ShardDataset):
    """Samples of one split, sliced from memory-mapped shards on demand:
    ``{"sample_id": int, "input_ids": LongTensor[T], "loss_mask": LongTensor[T]}``."""

    def __getitem__(self, i: int) -> dict:
        item, sid = self.rows(i, ("input_ids", "loss_mask"))
        return {"sample_id": sid, **{k: v.long() for k, v in item.items()}}
