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

Writes (data/store_writer.py) are atomic (tmp file, fsync, os.replace, then the manifest), and a
chunk is recorded as done only with its shard, so a killed harvest resumes
at the first chunk not done, with nothing lost or duplicated. Each shard's entry
keeps what its chunk added to the counts, so that a rerun can drop a chunk whose
shard is damaged or missing and harvest it again (FeatureWriter.drop_damaged).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3ft.files import read_json, safetensors_keys, sha256_file

if TYPE_CHECKING:
    from eagle3ft.drafter.folder import DrafterFolder

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


def read_manifest(folder: Path, store: str, schema_version: int, kind: str | None = None) -> dict:
    """A store's manifest (`store`: "feature store", "token store"), refused unless it is a JSON object of this
    code's schema and, where given, of this `kind`."""
    path = folder / MANIFEST
    if not path.is_file():
        raise StoreError(f"no {store} at {folder} (missing {MANIFEST})")
    manifest = read_json(path, f"the {store}'s manifest")
    if not isinstance(manifest, dict):
        raise StoreError(f"{path}: not a {store} manifest (a JSON object expected)")
    if kind is not None and manifest.get("kind") != kind:
        raise StoreError(f"{path}: not a {store} (kind {manifest.get('kind')!r})")
    if manifest.get("schema_version") != schema_version:
        raise StoreError(f"{path}: schema_version {manifest.get('schema_version')} != {schema_version} (this code)")
    return manifest


def check_shards(folder: Path, shards, verify: bool) -> None:
    """Every listed shard: an entry of a known split naming a file inside `folder` that is there and, with `verify`,
    passes its sha256."""
    path = folder / MANIFEST
    if not isinstance(shards, list):
        raise StoreError(f"{path}: shards is not a list")
    for s in shards:
        if not isinstance(s, dict) or s.get("split") not in SPLITS:
            raise StoreError(f"{path}: shard entry {s!r} is not a shard of a split in {SPLITS}")
        f = member(folder, s.get("file"), path)
        if not f.is_file():
            raise StoreError(f"{folder}: shard {s['file']} is missing")
        if verify and sha256_file(f) != s.get("sha256"):
            raise StoreError(f"{folder}: shard {s['file']} fails its sha256 check")


class FeatureStore:
    """Reader. Checks schema and checksums on open (verify=False skips the hashing)."""

    def __init__(self, features_dir: str | Path, verify: bool = True):
        self.dir = Path(features_dir)
        path = self.dir / MANIFEST
        self.manifest = read_manifest(self.dir, "feature store", SCHEMA_VERSION)
        if self.manifest.get("aux_dtype", "bf16") not in AUX_DTYPES:
            raise StoreError(f"{path}: aux_dtype {self.manifest['aux_dtype']!r} is not one of {', '.join(AUX_DTYPES)}")
        lacking = [k for k in ("target", "topk", "has_last_hidden", "shards") if k not in self.manifest]
        if lacking:
            raise StoreError(f"{path}: the manifest lacks {', '.join(lacking)}")
        if not self.manifest["shards"]:
            raise StoreError(f"{self.dir}: the store has no shards")
        check_shards(self.dir, self.manifest["shards"], verify)
        if self.manifest.get("token_counts") is not None:
            member(self.dir, self.manifest["token_counts"], path)

    @property
    def target(self) -> dict:
        return self.manifest["target"]

    def check_drafter(self, folder: DrafterFolder) -> DrafterFolder:
        """The drafter folder's one check against these features' target (it must fit what it was trained on)."""
        return folder.check(self.target, str(self.dir / MANIFEST))

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


def check_run_drafter(folder: DrafterFolder, features_dir: str | Path) -> DrafterFolder:
    """The folder's one check against the feature store in `features_dir` when there is one (checksums unread),
    else against the folder alone: a bench or an offline τ on prompts needs no features."""
    if (Path(features_dir) / MANIFEST).is_file():
        return FeatureStore(features_dir, verify=False).check_drafter(folder)
    return folder.check()
