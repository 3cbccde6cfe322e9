"""The feature store: the schema between harvest and training.

``features/`` holds ``manifest.json`` and shards ``{split}-{NNNNN}.safetensors``
(NNNNN = the chunk of the deterministic sample order that the shard holds).
Each shard concatenates its samples along the token axis:

    input_ids      int32   [N_tok]
    loss_mask      uint8   [N_tok]        1 on assistant tokens (end-of-turn included)
    aux_hidden     bf16    [N_tok, 3*Ht]  aux layers' outputs at token t (or fp8 e4m3, manifest aux_dtype "fp8")
    aux_scale      float32 [N_tok, 3]     fp8 only: per token and aux layer, amax / 448; the reader multiplies back
    topk_ids       int32   [N_tok, K]     target's top-K next-token ids at position t (over token t+1)
    topk_logprobs  float32 [N_tok, K]     their log-probs (temperature 1, sorted descending)
    last_hidden    bf16    [N_tok, Ht]    optional, final-norm output
    offsets        int64   [N+1]          sample i = rows offsets[i]:offsets[i+1]
    sample_ids     int64   [N]
    source_ids     int32   [N]            index into the shard's manifest entry ``sources`` (the names of
                                          harvest.sources, data/prompts.py source_name); a store written
                                          without it has no names

Writes are atomic (tmp file, fsync, os.replace, then the manifest), and a
chunk is recorded as done only with its shard, so a killed harvest resumes
at the first chunk not done, with nothing lost or duplicated. Each shard's entry
keeps what its chunk added to the counts, so that a rerun can drop a chunk whose
shard is damaged or missing and harvest it again (FeatureWriter.drop_damaged).
"""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from eagle3ft.files import read_json, safetensors_keys, sha256_file, write_atomic, write_json

SCHEMA_VERSION = 1
SPLITS = ("train", "heldout")
MANIFEST = "manifest.json"
TOKEN_COUNTS = "token_counts.safetensors"
KEYS = ("input_ids", "loss_mask", "aux_hidden", "topk_ids", "topk_logprobs", "last_hidden")
DTYPES = {
    "input_ids": torch.int32,
    "loss_mask": torch.uint8,
    "aux_hidden": torch.bfloat16,
    "topk_ids": torch.int32,
    "topk_logprobs": torch.float32,
    "last_hidden": torch.bfloat16,
}


AUX_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}  # harvest.aux_dtype
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def quantize_aux(aux: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, L*H) -> fp8 e4m3 (N, L*H) and float32 scales (N, L): each token's layer chunk scaled to its amax."""
    N = aux.shape[0]
    x = aux.float().view(N, -1, hidden_size)  # (N, L, H)
    scale = x.abs().amax(-1) / FP8_MAX  # (N, L)
    q = (x / scale.clamp(min=1e-30)[..., None]).to(torch.float8_e4m3fn)
    return q.view(N, -1), scale


def dequantize_aux(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 (N, L*H) and scales (N, L) -> bf16 (N, L*H), as the drafter reads aux states."""
    N, L = scale.shape
    return (q.float().view(N, L, -1) * scale[..., None]).view(N, -1).to(torch.bfloat16)


class StoreError(RuntimeError):
    """A feature store that is missing, empty, of another schema, corrupt, or of another harvest."""


_MEMBER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors")


def member(features_dir: Path, name, manifest: Path) -> Path:
    """features_dir/name for a file the manifest lists; StoreError unless it is a plain file name there."""
    if not isinstance(name, str) or not _MEMBER.fullmatch(name):
        raise StoreError(
            f"{manifest}: entry {name!r} is not a *.safetensors file name inside {features_dir} (no folders, '..' or "
            "absolute paths)"
        )
    return features_dir / name


def shard_problem(features_dir: Path, shard: dict, manifest: Path) -> str | None:
    """What is wrong with a listed shard (missing, fails its sha256), or None."""
    f = member(features_dir, shard.get("file"), manifest)
    if not f.is_file():
        return "missing"
    return "fails its sha256 check" if sha256_file(f) != shard.get("sha256") else None


def damaged_shards(features_dir: Path, shards: list[dict], manifest: Path) -> list[str]:
    """'name: what is wrong' for every listed shard that is missing or fails its sha256."""
    return [f"{s['file']}: {why}" for s in shards if (why := shard_problem(features_dir, s, manifest))]


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
    folder: Path, fresh: dict, keys: tuple[str, ...], store: str, holds: str, defaults: dict | None = None
) -> dict:
    """The manifest of a store being (re)opened for writing: `fresh` for a new folder, else the folder's own,
    refused unless it agrees with `fresh` on `keys` (another harvest or run must go to a new run dir)."""
    path = folder / MANIFEST
    if not path.exists():
        return fresh
    old = {**(defaults or {}), **read_json(path, f"{store}'s manifest")}
    for k in keys:
        if old.get(k) != fresh[k]:
            raise StoreError(
                f"{folder} holds {holds} with another {k} ({old.get(k)!r} != {fresh[k]!r}); use a new run dir"
            )
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
        fresh = {
            "schema_version": SCHEMA_VERSION,
            "target": target,
            "topk": topk,
            "has_last_hidden": has_last_hidden,
            "aux_dtype": aux_dtype,
            "fingerprint": fingerprint,
            "shards": [],
            "chunks_done": {s: [] for s in SPLITS},
            "counts": {s: {"samples": 0, "tokens": 0, "loss_tokens": 0} for s in SPLITS},
            "chunk_skips": {},  # skips inside committed chunks (the harvest adds prompt-level skips at the end)
            "skips": {},
            "token_counts": None,
            "complete": False,
        }
        keys = ("schema_version", "target", "topk", "has_last_hidden", "aux_dtype", "fingerprint")
        before_aux_dtype = {"aux_dtype": "bf16"}  # stores written before the option
        self.manifest = open_manifest(self.dir, fresh, keys, "the feature store", "a harvest", before_aux_dtype)

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


def shard_sources(folder: Path, manifest: dict, split: str) -> list[str | None]:
    """The source name of each sample of `split` in a store's shards (features or tokens), in dataset order; None
    where the store recorded none."""
    out: list[str | None] = []
    for s in manifest["shards"]:
        if s["split"] != split:
            continue
        if "sources" not in s:
            out += [None] * s["samples"]
            continue
        with safe_open(folder / s["file"], framework="pt") as f:
            out += [s["sources"][i] for i in f.get_tensor("source_ids").tolist()]
    return out


class FeatureStore:
    """Reader. Checks schema and checksums on open (verify=False skips the hashing)."""

    def __init__(self, features_dir: str | Path, verify: bool = True):
        self.dir = Path(features_dir)
        path = self.dir / MANIFEST
        if not path.is_file():
            raise StoreError(f"no feature store at {self.dir} (missing {MANIFEST})")
        self.manifest = read_json(path, "the feature store's manifest")
        if not isinstance(self.manifest, dict):
            raise StoreError(f"{path}: not a feature store manifest (a JSON object expected)")
        version = self.manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise StoreError(f"{path}: schema_version {version} != {SCHEMA_VERSION} (this code)")
        if self.manifest.get("aux_dtype", "bf16") not in AUX_DTYPES:
            raise StoreError(f"{path}: aux_dtype {self.manifest['aux_dtype']!r} is not one of {', '.join(AUX_DTYPES)}")
        lacking = [k for k in ("target", "topk", "has_last_hidden", "shards") if k not in self.manifest]
        if lacking:
            raise StoreError(f"{path}: the manifest lacks {', '.join(lacking)}")
        if not self.manifest["shards"]:
            raise StoreError(f"{self.dir}: the store has no shards")
        for s in self.manifest["shards"]:
            if not isinstance(s, dict) or s.get("split") not in SPLITS:
                raise StoreError(f"{path}: shard entry {s!r} is not a shard of a split in {SPLITS}")
            f = member(self.dir, s.get("file"), path)
            if not f.is_file():
                raise StoreError(f"{self.dir}: shard {s['file']} is missing")
            if verify and sha256_file(f) != s.get("sha256"):
                raise StoreError(f"{self.dir}: shard {s['file']} fails its sha256 check")
        if self.manifest.get("token_counts") is not None:
            member(self.dir, self.manifest["token_counts"], path)

    @property
    def target(self) -> dict:
        return self.manifest["target"]

    @property
    def topk(self) -> int:
        return self.manifest["topk"]

    def shards(self, split: str) -> list[Path]:
        return [self.dir / s["file"] for s in self.manifest["shards"] if s["split"] == split]

    def token_counts(self) -> torch.Tensor:
        name = self.manifest.get("token_counts")
        if not name:
            raise StoreError(f"{self.dir}: the harvest did not finish (no token counts)")
        path = member(self.dir, name, self.dir / MANIFEST)
        if "token_counts" not in safetensors_keys(path, "the token counts"):
            raise StoreError(f"{path}: holds no token_counts tensor")
        return load_file(path)["token_counts"]

    def sources(self, split: str) -> list[str | None]:
        """The source name of each sample of `split`, in dataset order (None where the harvest recorded none)."""
        return shard_sources(self.dir, self.manifest, split)

    def dataset(self, split: str = "train", keys: tuple[str, ...] | None = None) -> "FeatureDataset":
        """Samples of `split`; `keys` reads only those (e.g. input_ids and loss_mask for online training)."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r} not in {SPLITS}")
        return FeatureDataset(
            self.shards(split), self.manifest["has_last_hidden"], keys, self.manifest.get("aux_dtype", "bf16") == "fp8"
        )


class ShardDataset(torch.utils.data.Dataset):
    """Samples of concatenated-token shards (``offsets``, ``sample_ids``), memory-mapped on demand; the
    feature store and the token store (data/tokens.py) both read theirs this way."""

    def __init__(self, shards: list[Path]):
        self.shards = shards
        self.index: list[tuple[int, int, int, int]] = []  # (shard, start, end, sample_id)
        for si, path in enumerate(shards):
            with safe_open(path, framework="pt") as f:
                offsets = f.get_tensor("offsets").tolist()
                ids = f.get_tensor("sample_ids").tolist()
            self.index += [(si, offsets[i], offsets[i + 1], ids[i]) for i in range(len(ids))]
        self._open: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.index)

    def lengths(self) -> list[int]:
        return [b - a for _, a, b, _ in self.index]

    def loss_tokens(self) -> list[int]:
        """Loss-masked (answer) tokens per sample, reading each sample's loss_mask alone."""
        return [int(self.rows(i, ["loss_mask"])[0]["loss_mask"].sum()) for i in range(len(self))]

    def subset(self, keep: list[int]) -> "ShardDataset":
        """The same samples' view over `keep` (indices into this one), in that order."""
        sub = copy.copy(self)
        sub.index, sub._open = [self.index[i] for i in keep], {}
        return sub

    def _handle(self, si: int):
        if si not in self._open:  # opened lazily, so each DataLoader worker maps its own
            self._open[si] = safe_open(self.shards[si], framework="pt")
        return self._open[si]

    def __getstate__(self):
        return {**self.__dict__, "_open": {}}

    def rows(self, i: int, keys) -> tuple[dict[str, torch.Tensor], int]:
        """({key: rows of sample i}, its sample id)."""
        si, a, b, sid = self.index[i]
        f = self._handle(si)
        return {k: f.get_slice(k)[a:b] for k in keys}, sid


class FeatureDataset(ShardDataset):
    """Samples of one split of the feature store (fp8 aux states come back as bf16)."""

    def __init__(
        self, shards: list[Path], has_last_hidden: bool, keys: tuple[str, ...] | None = None, aux_fp8: bool = False
    ):
        super().__init__(shards)
        self.aux_fp8 = aux_fp8
        self.keys = [k for k in KEYS if (k != "last_hidden" or has_last_hidden) and (keys is None or k in keys)]

    def __getitem__(self, i: int) -> dict:
        fp8 = self.aux_fp8 and "aux_hidden" in self.keys
        item, sid = self.rows(i, self.keys + ["aux_scale"] if fp8 else self.keys)
        for k in ("input_ids", "loss_mask", "topk_ids"):
            if k in item:
                item[k] = item[k].long()
        if fp8:
            item["aux_hidden"] = dequantize_aux(item["aux_hidden"], item.pop("aux_scale"))
        item["sample_id"] = sid
        return item


def collate(items: list[dict], max_len: int | None = None) -> dict:
    """Pad to (B, T, ...) on the right, truncating to max_len; adds attention_mask.

    Padding rows are zeros (loss_mask 0, attention_mask 0).
    """
    T = max(len(it["input_ids"]) for it in items)
    if max_len is not None:
        T = min(T, max_len)
    out = {}
    for k in items[0]:
        if k == "sample_id":
            continue
        first = items[0][k]
        buf = torch.zeros((len(items), T, *first.shape[1:]), dtype=first.dtype)
        for b, it in enumerate(items):
            x = it[k][:T]
            buf[b, : len(x)] = x
        out[k] = buf
    out["attention_mask"] = torch.zeros((len(items), T), dtype=torch.long)
    for b, it in enumerate(items):
        out["attention_mask"][b, : min(T, len(it["input_ids"]))] = 1
    out["sample_id"] = torch.tensor([it["sample_id"] for it in items], dtype=torch.long)
    return out
