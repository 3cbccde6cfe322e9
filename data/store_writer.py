"""Writing stores: FeatureWriter (atomic shard commits, the manifest, resume) and the shard writes tokens.py shares."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from eagle3ft.data.store import (
    AUX_DTYPES,
    DTYPES,
    KEYS,
    MANIFEST,
    SCHEMA_VERSION,
    SPLITS,
    TOKEN_COUNTS,
    StoreError,
    damaged_shards,
    quantize_aux,
    shard_problem,
)
from eagle3ft.files import read_json, write_atomic, write_json


@dataclass
class Sample:
    """One harvested sequence; tensors have T rows."""

    sample_id: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    last_hidden: torch.Tensor | None = None
    source: str | None = None  # the prompt source it came from (data/prompts.py source_name)


def shard_name(split: str, chunk: int) -> str:
    return f"{split}-{chunk:05d}.safetensors"


def open_manifest(
    folder: Path,
    identity: dict,
    count_keys: tuple[str, ...],
    store: str,
    holds: str,
    defaults: dict | None = None,
    extra: dict | None = None,
) -> dict:
    """The manifest of a store being (re)opened for writing. A new folder gets `identity`, no shards, zero counts
    per split (`count_keys`) and `extra`; an existing one keeps its own, refused unless it agrees with `identity` on
    every key (another harvest or run must go to a new run dir). `defaults` fill keys older stores lack."""
    path = folder / MANIFEST
    if not path.exists():
        return {
            **identity,
            "shards": [],
            "chunks_done": {s: [] for s in SPLITS},
            "counts": {s: {k: 0 for k in count_keys} for s in SPLITS},
            "chunk_skips": {},  # skips inside committed chunks (a stage adds its prompt-level skips at the end)
            "skips": {},
            **(extra or {}),
            "complete": False,
        }
    old = {**(defaults or {}), **read_json(path, f"{store}'s manifest")}
    for k, v in identity.items():
        if old.get(k) != v:
            raise StoreError(f"{folder} holds {holds} with another {k} ({old.get(k)!r} != {v!r}); use a new run dir")
    return old


def write_shard(
    folder: Path,
    manifest: dict,
    split: str,
    chunk: int,
    tensors: dict,
    n_samples: int,
    schema_version: int = SCHEMA_VERSION,
) -> dict:
    """Write one chunk's shard atomically and enter it in the manifest (not yet saved); returns the split's counts."""
    data = save(tensors, metadata={"schema_version": str(schema_version)})  # one key: the header is byte-stable
    name = shard_name(split, chunk)
    write_atomic(folder / name, data)
    n_tok, n_loss = int(tensors["input_ids"].numel()), int(tensors["loss_mask"].sum())
    manifest["shards"].append(
        {
            "file": name,
            "split": split,
            "chunk": chunk,
            "samples": n_samples,
            "tokens": n_tok,
            "loss_tokens": n_loss,
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    )
    c = manifest["counts"][split]
    c["samples"] += n_samples
    c["tokens"] += n_tok
    c["loss_tokens"] += n_loss
    return c


class FeatureWriter:
    """Commits whole shards and keeps the manifest; reopening the same folder resumes.

    `identity` (target, topk, sample order fingerprint, ...) must match the
    manifest of an existing folder, or the writer refuses to mix harvests.
    """

    def __init__(
        self,
        features_dir: str | Path,
        target: dict,
        topk: int,
        has_last_hidden: bool,
        fingerprint: str,
        aux_dtype: str = "bf16",
    ):
        if aux_dtype not in AUX_DTYPES:
            raise ValueError(f"harvest.aux_dtype {aux_dtype!r} is not one of {', '.join(AUX_DTYPES)}")
        self.dir = Path(features_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        identity = {
            "schema_version": SCHEMA_VERSION,
            "target": target,
            "topk": topk,
            "has_last_hidden": has_last_hidden,
            "aux_dtype": aux_dtype,
            "fingerprint": fingerprint,
        }
        before_aux_dtype = {"aux_dtype": "bf16"}  # stores written before the option
        self.manifest = open_manifest(
            self.dir,
            identity,
            ("samples", "tokens", "loss_tokens"),
            "the feature store",
            "a harvest",
            defaults=before_aux_dtype,
            extra={"token_counts": None},
        )

    def done(self, split: str) -> set[int]:
        return set(self.manifest["chunks_done"][split])

    def damaged(self) -> list[str]:
        """Committed shards that are missing or fail their sha256 (checked before a rerun adds to the store)."""
        return damaged_shards(self.dir, self.manifest["shards"], self.dir / MANIFEST)

    def drop_damaged(self) -> list[str]:
        """Forget every committed chunk whose shard is missing or fails its sha256, with what it added to the counts
        (and the damaged file), so that this harvest does the chunk again; the store is incomplete until it finishes.
        Returns 'file: what was wrong' for each. (A shard committed before its entry kept its chunk's skips and checks
        leaves those counted.)"""
        m, path = self.manifest, self.dir / MANIFEST
        dropped = [(s, why) for s in m["shards"] if (why := shard_problem(self.dir, s, path))]
        for s, _ in dropped:
            m["shards"].remove(s)
            m["chunks_done"][s["split"]].remove(s["chunk"])
            c = m["counts"][s["split"]]
            c["samples"] -= s["samples"]
            c["tokens"] -= s["tokens"]
            for reason, n in s.get("skips", {}).items():
                m["chunk_skips"][reason] -= n
            for group, kv in s.get("counts", {}).items():
                for k, n in kv.items():
                    m["chunk_counts"][group][k] -= n
            (self.dir / s["file"]).unlink(missing_ok=True)
        for split in {s["split"] for s, _ in dropped}:  # entries of older stores lack loss_tokens: read the masks
            shards = [s for s in m["shards"] if s["split"] == split]
            m["counts"][split]["loss_tokens"] = sum(
                s["loss_tokens"] if "loss_tokens" in s else int(load_file(self.dir / s["file"])["loss_mask"].sum())
                for s in shards
            )
        if dropped:
            m["complete"], m["token_counts"] = False, None
            self._save()
        return [f"{s['file']}: {why}" for s, why in dropped]

    def commit(
        self,
        split: str,
        chunk: int,
        samples: list[Sample],
        skips: dict[str, int],
        counts: dict[str, dict[str, int]] | None = None,
    ) -> None:
        """Write one chunk's shard (if it kept any sample) and record the chunk as done.

        `counts` ({"argmax_check": {"checked": n, ...}}) are summed into the manifest's `chunk_counts` with it."""
        m = self.manifest
        if chunk in m["chunks_done"][split]:
            raise StoreError(f"chunk {split}/{chunk} is already committed")
        if samples:
            fp8 = m["aux_dtype"] == "fp8"
            tensors = pack(samples, m["has_last_hidden"], m["aux_dtype"], m["target"]["hidden_size"] if fp8 else None)
            names = source_names(samples)
            if names is not None:
                tensors["source_ids"] = torch.tensor([names.index(s.source) for s in samples], dtype=torch.int32)
            write_shard(self.dir, m, split, chunk, tensors, len(samples))
            m["shards"][-1].update(skips=dict(skips), counts=counts or {})  # taken back if the shard is dropped
            shard = self.dir / m["shards"][-1]["file"]
            if names is not None:
                m["shards"][-1]["sources"] = names
        for reason, n in skips.items():
            m["chunk_skips"][reason] = m["chunk_skips"].get(reason, 0) + n
        for group, kv in (counts or {}).items():
            into = m.setdefault("chunk_counts", {}).setdefault(group, {})
            for k, n in kv.items():
                into[k] = into.get(k, 0) + n
        m["chunks_done"][split].append(chunk)
        try:
            self._save()
        except BaseException:  # a full disk: the shard the manifest does not list goes too
            if samples:
                shard.unlink(missing_ok=True)
            raise

    def finish(self, token_counts: torch.Tensor, extra: dict | None = None) -> None:
        write_atomic(self.dir / TOKEN_COUNTS, save({"token_counts": token_counts.to(torch.int64)}))
        self.manifest["token_counts"] = TOKEN_COUNTS
        self.manifest["complete"] = True
        self.manifest.update(extra or {})
        self._save()

    def _save(self) -> None:
        self.manifest["shards"].sort(key=lambda s: (SPLITS.index(s["split"]), s["chunk"]))
        for done in self.manifest["chunks_done"].values():  # a chunk done again after a drop goes back in its place
            done.sort()
        write_json(self.dir / MANIFEST, self.manifest)


def pack(
    samples: list[Sample], has_last_hidden: bool, aux_dtype: str = "bf16", hidden_size: int | None = None
) -> dict[str, torch.Tensor]:
    """Concatenate samples along the token axis in the schema's dtypes (aux states in fp8 + scales for "fp8")."""
    keys = [k for k in KEYS if k != "last_hidden" or has_last_hidden]
    out = {k: torch.cat([getattr(s, k) for s in samples]).to(DTYPES[k]).contiguous() for k in keys}
    if aux_dtype == "fp8":
        out["aux_hidden"], out["aux_scale"] = quantize_aux(out["aux_hidden"], hidden_size)
    lengths = torch.tensor([len(s.input_ids) for s in samples], dtype=torch.int64)
    out["offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    out["sample_ids"] = torch.tensor([s.sample_id for s in samples], dtype=torch.int64)
    return out


def source_names(samples: list[Sample]) -> list[str] | None:
    """The sorted source names a shard's source_ids index, or None when a sample has no source."""
    if any(s.source is None for s in samples):
        return None
    return sorted({s.source for s in samples})
