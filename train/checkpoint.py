"""Drafter checkpoints in SGLang's form, and resumable training checkpoints.

SGLang form (what `--speculative-draft-model-path` loads): `config.json` + `model.safetensors` with
exactly the keys of `model.export_keys()` (`model_mla.mla_export_keys()` for the MLA layout); SGLang's
loader skips unknown keys silently, so every write checks the key set.

A training checkpoint `ckpt/step-N/` is that plus the state to resume, in files that hold data only
(safetensors and JSON: loading one runs no code) and that do not depend on the number of processes:
  state.safetensors   fp32.<param>, exp_avg.<param>, exp_avg_sq.<param>: the whole fp32 master weight
                      and Adam moments of every trainable parameter; rank<r>.torch_cpu (uint8),
                      rank<r>.torch_cuda (uint8, on CUDA), rank<r>.numpy_keys: each rank's RNG states
  state.json          optimizer (class, step count, hyper-parameters per group, parameter names),
                      LR scheduler state, engine counters, the Python/NumPy RNG scalars per rank
  trainer_state.json  format, step, data position (epoch, samples of its seeded order consumed),
                      world size, batch shape, total steps, resolved config, last metrics; written last
Folders are written under a temporary name and renamed, so a reader never sees half a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from eagle3ft.drafter_config import LLAMA_EAGLE3, MLA_EAGLE3, DrafterConfig
from eagle3ft.train.model import Eagle3Drafter, export_keys
from eagle3ft.train.model_mla import mla_export_keys, new_drafter

CONFIG, WEIGHTS, TRAINER_STATE, STATE_TENSORS, STATE_JSON = (
    "config.json",
    "model.safetensors",
    "trainer_state.json",
    "state.safetensors",
    "state.json",
)
FORMAT = "eagle3ft-train-state-2"
IGNORED_KEYS = ("embed_tokens.weight",)  # filled from the target by SGLang and by `load_drafter`


# SGLang's LlamaForCausalLMEagle3 parameters (embed_tokens aside, which it fills from the target) and the
# shards its load_weights fills in each: q/k/v are stacked into qkv_proj, gate/up into gate_up_proj, and a
# key is tried as written, then with "model." in front; d2t becomes hot_token_id, t2d is read and dropped.
SGLANG_PARAMS = {
    "model.fc.weight": {""},
    "model.midlayer.self_attn.qkv_proj.weight": {"q", "k", "v"},
    "model.midlayer.self_attn.o_proj.weight": {""},
    "model.midlayer.mlp.gate_up_proj.weight": {"0", "1"},
    "model.midlayer.mlp.down_proj.weight": {""},
    "model.midlayer.input_layernorm.weight": {""},
    "model.midlayer.hidden_norm.weight": {""},
    "model.midlayer.post_attention_layernorm.weight": {""},
    "model.norm.weight": {""},
    "lm_head.weight": {""},
}
# parameters SGLang builds only when the drafter's config.json sets fc_norm (or use_aux_norm): EAGLE-3.1
SGLANG_FC_NORM_PARAMS = {f"model.fc_norm.{i}.weight": {""} for i in range(3)}
SGLANG_STACKED = (
    (".q_proj", ".qkv_proj", "q"),
    (".k_proj", ".qkv_proj", "k"),
    (".v_proj", ".qkv_proj", "v"),
    (".gate_proj", ".gate_up_proj", "0"),
    (".up_proj", ".gate_up_proj", "1"),
)


def sglang_target(key: str) -> tuple[str, str] | None:
    """(SGLang parameter, shard) that SGLang's Eagle3 load_weights writes `key` into; None if it skips the key."""
    shard = ""
    for ours, theirs, sid in SGLANG_STACKED:
        if ours in key:
            key, shard = key.replace(ours, theirs), sid
            break
    for name in (key, f"model.{key}"):
        if name in SGLANG_PARAMS or name in SGLANG_FC_NORM_PARAMS:
            return name, shard
    return None


# SGLang's Eagle3DeepseekV2ForCausalLM parameters (models/kimi_k25_eagle3.py) and the shards its load_weights fills:
# a key's leading "layers.0." becomes "midlayer." and every key but lm_head.* gets "model." in front (no fallback);
# gate/up are stacked into gate_up_proj; q_a_proj and kv_a_proj_with_mqa are held until both came, then concatenated
# (q first) into fused_qkv_a_proj_with_mqa; anything else not a parameter is skipped with a warning.
_MLA_ATTN = ("q_a_layernorm", "q_b_proj", "kv_a_layernorm", "kv_b_proj", "o_proj")
SGLANG_MLA_PARAMS = {
    **{k: v for k, v in SGLANG_PARAMS.items() if ".self_attn." not in k},
    "model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight": {"q_a", "kv_a"},
    **{f"model.midlayer.self_attn.{p}.weight": {""} for p in _MLA_ATTN},
}


def sglang_mla_target(key: str) -> tuple[str, str] | None:
    """(SGLang parameter, shard) that Eagle3DeepseekV2ForCausalLM.load_weights writes `key` into; None if skipped."""
    name = re.sub(r"^layers\.0\.", "midlayer.", key)
    name = name if name.startswith("lm_head.") else f"model.{name}"
    params = {**SGLANG_MLA_PARAMS, **SGLANG_FC_NORM_PARAMS}
    for ours, theirs, sid in SGLANG_STACKED[3:]:  # gate/up only
        if ours in name and name.replace(ours, theirs) in params:
            return name.replace(ours, theirs), sid
    for part, sid in (("q_a_proj", "q_a"), ("kv_a_proj_with_mqa", "kv_a")):
        if part in name:
            return name.replace(part, "fused_qkv_a_proj_with_mqa"), sid
    return (name, "") if name in params else None


# architecture -> (its parameters, the loader's rule, the keys we export)
LAYOUTS = {
    LLAMA_EAGLE3: (SGLANG_PARAMS, sglang_target, export_keys),
    MLA_EAGLE3: (SGLANG_MLA_PARAMS, sglang_mla_target, mla_export_keys),
}


def check_keys(keys, where: str, fc_norm: bool | None = None, architecture: str | None = None) -> None:
    """Raise ValueError unless SGLang's loader reads every key, fills every parameter shard, and gets d2t/t2d.

    fc_norm: whether the drafter's config sets fc_norm (SGLang then has model.fc_norm.{i}); None infers it from the
    keys. architecture: the config's architectures[0]; None infers MLA from an MLA projection's key.
    """
    keys = set(keys)
    if fc_norm is None:
        fc_norm = any(k.startswith("fc_norm.") for k in keys)
    if architecture is None:
        mla = ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj")
        architecture = MLA_EAGLE3 if any(p in k for k in keys for p in mla) else LLAMA_EAGLE3
    if architecture not in LAYOUTS:
        raise ValueError(f"{where}: drafter architecture {architecture} is not one of {', '.join(LAYOUTS)}")
    layout_params, target, expected_keys = LAYOUTS[architecture]
    params = {**layout_params, **(SGLANG_FC_NORM_PARAMS if fc_norm else {})}
    filled = {target(k) for k in keys} - {None}
    unread = sorted(k for k in keys - {"d2t", "t2d"} if target(k) is None or target(k)[0] not in params)
    unfilled = sorted(f"{p}[{s}]" if s else p for p, shards in params.items() for s in shards if (p, s) not in filled)
    missing = sorted({"d2t", "t2d"} - keys)
    expected = expected_keys(fc_norm)
    if unread or unfilled or missing or keys != set(expected):
        raise ValueError(
            f"{where}: drafter keys do not load into SGLang's {architecture} (skipped silently: {unread}; "
            f"left unfilled: {unfilled}; missing: {missing}; expected exactly {sorted(expected)})"
        )


def drafter_tensors(state_dict: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """The exportable tensors of a (possibly wrapped) drafter state dict, keys without `prefix`."""
    out = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    out = {k: v.detach().cpu().contiguous() for k, v in out.items() if k not in IGNORED_KEYS}
    check_keys(out, "export")
    return out


@contextmanager
def atomic_dir(final: Path):
    """Yield a temporary sibling folder; on success it replaces `final` in one rename."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def write_drafter(folder: Path, cfg: DrafterConfig, tensors: dict[str, torch.Tensor]) -> None:
    check_keys(tensors, str(folder), cfg.fc_norm, cfg.architecture)
    (folder / CONFIG).write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})


def export_drafter(model: Eagle3Drafter, folder: str | Path) -> Path:
    """Write `model` in SGLang's form (no embed_tokens), atomically; returns the folder."""
    folder = Path(folder)
    with atomic_dir(folder) as tmp:
        write_drafter(tmp, model.config, drafter_tensors(model.state_dict()))
    return folder


def read_drafter_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a drafter folder's *.safetensors files, without a leading `model.` and embed_tokens."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors drafter weights")
    out = {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            for k in h.keys():
                out[k.removeprefix("model.")] = h.get_tensor(k)
    return {k: v for k, v in out.items() if k not in IGNORED_KEYS}


def load_drafter(folder: str | Path, embedding: torch.Tensor | None = None) -> Eagle3Drafter:
    """A drafter from SGLang's form (either layout: train/model_mla.py's new_drafter); `embedding` (V, H) is the
    target's input embedding."""
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        raise FileNotFoundError(f"{folder}: no {CONFIG} (expected a drafter in SGLang's form)")
    cfg = DrafterConfig.from_json(folder / CONFIG)
    tensors = read_drafter_tensors(folder)
    if cfg.architecture == MLA_EAGLE3:  # SGLang's MLA loader reads checkpoints that name the midlayer layers.0
        tensors = {re.sub(r"^layers\.0\.", "midlayer.", k): v for k, v in tensors.items()}
    check_keys(tensors, str(folder), cfg.fc_norm, cfg.architecture)
    model = new_drafter(cfg)
    dtype = next(iter(v for k, v in tensors.items() if k.endswith(".weight"))).dtype
    model.to(dtype)
    if embedding is not None:
        if tuple(embedding.shape) != tuple(model.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding shape {tuple(embedding.shape)} != drafter's (vocab_size, hidden_size) "
                f"{tuple(model.embed_tokens.weight.shape)}"
            )
        tensors = {**tensors, "embed_tokens.weight": embedding}
    model.load_state_dict(tensors, strict=False)  # keys checked above; embed_tokens stays as built without `embedding`
    return model


# --------------------------------------------------------------------------- training checkpoints


def step_dirs(run_dir: Path) -> list[Path]:
    """Every ckpt/step-N folder, oldest first."""
    found = [p for p in (Path(run_dir) / "ckpt").glob("step-*") if re.fullmatch(r"step-\d+", p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def checkpoints(run_dir: Path) -> list[Path]:
    """Complete ckpt/step-N folders (trainer_state.json is written last), oldest first."""
    return [p for p in step_dirs(run_dir) if (p / TRAINER_STATE).is_file()]


def resume_path(run_dir: Path, resume: str | None) -> Path | None:
    """None, the newest checkpoint for 'auto' (None when there is none), or the named folder."""
    if resume is None:
        return None
    if resume == "auto":
        found = checkpoints(run_dir)
        return found[-1] if found else None
    p = Path(resume)
    if not (p / TRAINER_STATE).is_file():
        raise FileNotFoundError(f"train.resume: {p} is not a checkpoint (no {TRAINER_STATE})")
    return p


class CheckpointError(ValueError):
    """A checkpoint file is missing, damaged or of another kind; the message names the file."""


def verify_checkpoint(path: Path) -> None:
    """CheckpointError naming the file unless the files a resume reads are whole: trainer_state.json (of this
    format), state.json, and state.safetensors (its header read, and the file as long as the header says)."""
    read_trainer_state(path)
    read_json(Path(path) / STATE_JSON)
    StateTensors(Path(path) / STATE_TENSORS)


def choose_resume(run_dir: Path, resume: str | None) -> tuple[Path | None, list[str]]:
    """(the checkpoint to resume from, why each newer one was passed over). A named folder is taken as it is (its
    damage is an error when it loads); 'auto' takes the newest that verifies and passes over the damaged ones, and is
    a CheckpointError when there are checkpoints but none verifies (None when there is none: a fresh start)."""
    if resume != "auto":
        return resume_path(run_dir, resume), []
    refused = []
    for ckpt in reversed(step_dirs(run_dir)):
        try:
            verify_checkpoint(ckpt)
            return ckpt, refused
        except CheckpointError as e:
            refused.append(str(e))
    if refused:
        raise CheckpointError(
            f"--resume auto: no checkpoint in {Path(run_dir) / 'ckpt'} verifies ({'; '.join(refused)}); start over "
            "with --overwrite"
        )
    return None, []


def read_json(path: Path) -> dict:
    """A JSON object from `path`; CheckpointError naming the file otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


class StateTensors:
    """The tensors of a state.safetensors, read one at a time (safetensors: no code runs)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._f = safe_open(str(self.path), framework="pt")
            self._keys = set(self._f.keys())
        except FileNotFoundError:
            raise CheckpointError(f"{self.path}: missing") from None
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{self.path}: not a readable safetensors file ({str(e).splitlines()[0]})") from None

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._f.get_slice(key).get_shape())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise CheckpointError(f"{self.path}: no tensor {key}")
        try:
            return self._f.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{self.path}: cannot read {key} ({str(e).splitlines()[0]})") from None


def save_checkpoint(dist, module, cfg: DrafterConfig, run_dir: Path, step: int, trainer_state: dict, keep: int) -> Path:
    """Collective: every rank calls it. Writes ckpt/step-N atomically (from the main process) and keeps the newest
    `keep`."""
    root = Path(run_dir) / "ckpt"
    final = root / f"step-{step}"
    tensors, meta = dist.training_state()
    state = dist.full_state_dict(module)
    if dist.is_main:
        tmp = root / f".step-{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_drafter(tmp, cfg, drafter_tensors(state, prefix="drafter."))
        save_file(tensors, str(tmp / STATE_TENSORS), metadata={"format": FORMAT})
        (tmp / STATE_JSON).write_text(json.dumps(meta, indent=1) + "\n")
        (tmp / TRAINER_STATE).write_text(json.dumps({"format": FORMAT, **trainer_state}, indent=1) + "\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    dist.barrier()
    return final


def read_trainer_state(path: Path) -> dict:
    """A checkpoint's trainer_state.json, refusing the older DeepSpeed form (pickled state/ files)."""
    st = read_json(Path(path) / TRAINER_STATE)
    if st.get("format") != FORMAT:
        raise CheckpointError(
            f"{Path(path) / TRAINER_STATE}: format {st.get('format')!r}, expected {FORMAT!r} (an older checkpoint "
            "keeps its "
            "training state in pickles, which are not loaded; start from its weights instead: --set "
            f"drafter.init={path})"
        )
    return st


def load_checkpoint(dist, path: Path, seed: int) -> tuple[dict, str]:
    """Restore optimizer, scheduler, engine counters and RNG from `path` (collective); returns (trainer_state, RNG
    note).

    Reads only trainer_state.json, state.json and state.safetensors; every problem is a CheckpointError naming the file.
    """
    path = Path(path)
    st = read_trainer_state(path)
    meta = read_json(path / STATE_JSON)
    tensors = StateTensors(path / STATE_TENSORS)
    try:
        opt = meta["optimizer"]
        shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in dist.trainable()}
        if list(shapes) != opt["params"]:
            raise CheckpointError(
                f"{path / STATE_JSON}: trainable parameters {opt['params']} differ from the drafter's {list(shapes)}"
            )
        for name, shape in shapes.items():
            for k in ("fp32", *opt["moments"]):
                key = f"{k}.{name}"
                if key not in tensors:
                    raise CheckpointError(f"{tensors.path}: no tensor {key}")
                if tensors.shape(key) != shape:
                    raise CheckpointError(
                        f"{tensors.path}: {key} has shape {list(tensors.shape(key))}, the drafter's is {list(shape)}"
                    )
        note = dist.load_training_state(tensors, meta, seed)
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{path / STATE_JSON}: missing or malformed entry {e}") from None
    return st, note


def resume_position(st: dict, path: Path, n_train: int, micro_batch_size: int, world: int) -> tuple[int, int]:
    """(epoch, micro-batches per rank to skip) to continue the seeded global sample order where `st` left it.

    The position is stored as samples consumed; on W processes of micro batch B, rank r reads global
    micro-batches r, r+W, ... of the epoch's order, so the position must split into rounds of W x B.
    """
    data = st.get("data")
    if not isinstance(data, dict) or not {"epoch", "samples_in_epoch", "n_train"} <= set(data):
        raise CheckpointError(
            f"{Path(path) / TRAINER_STATE}: no data position (data.epoch, data.samples_in_epoch, data.n_train)"
        )
    if data["n_train"] != n_train:
        raise CheckpointError(
            f"{Path(path) / TRAINER_STATE}: written for {data['n_train']} training samples, the store has {n_train}"
        )
    epoch, done = data["epoch"], data["samples_in_epoch"]
    if done >= n_train:
        return epoch + 1, 0
    per_round = world * micro_batch_size
    if done % per_round:
        raise CheckpointError(
            f"{Path(path) / TRAINER_STATE}: {done} samples of epoch {epoch} consumed do not split into rounds of "
            f"{per_round} "
            f"({world} process(es) x train.micro_batch_size {micro_batch_size}); resume with processes x micro batch "
            f"dividing {done}"
        )
    return epoch, done // per_round


def truncate_metrics(path: Path, step: int) -> int:
    """Drop the records of `path` (metrics.jsonl) past `step`, in one rename; returns how many were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a line cut short by a kill
    if len(keep) == len(lines):
        return 0
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return len(lines) - len(keep)
