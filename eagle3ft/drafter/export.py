"""A drafter folder in SGLang's form: what `--speculative-draft-model-path` (and vLLM's eagle3 method) loads.

`config.json` + `model.safetensors` with exactly the keys of `model.export_keys()` (`model_mla.mla_export_keys()`
for the MLA layout); SGLang's loader skips unknown keys silently, so every write and read checks the key set
against the parameters and shards SGLang's load_weights fills (`check_keys`).
"""

from __future__ import annotations

import re
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3ft.drafter.config import LLAMA_EAGLE3, MLA_EAGLE3, DrafterConfig
from eagle3ft.drafter.model import Eagle3Drafter, export_keys
from eagle3ft.drafter.model_mla import mla_export_keys, new_drafter
from eagle3ft.files import as_umask_allows, check_finite, disk_full, json_text

CONFIG, WEIGHTS = "config.json", "model.safetensors"
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


def sglang_upper_params(i: int) -> dict[str, set[str]]:
    """Layer i >= 1 of a deeper drafter (SGLang names the midlayer layers.0): what load_weights fills there. SGLang's
    forward never reads its `input_layernorm` (it norms with hidden_norm), vLLM's reads only that one."""
    p = f"model.layers.{i}"
    return {
        f"{p}.input_layernorm.weight": {""},
        f"{p}.self_attn.qkv_proj.weight": {"q", "k", "v"},
        f"{p}.self_attn.o_proj.weight": {""},
        f"{p}.mlp.gate_up_proj.weight": {"0", "1"},
        f"{p}.mlp.down_proj.weight": {""},
        f"{p}.hidden_norm.weight": {""},
        f"{p}.post_attention_layernorm.weight": {""},
    }


def sglang_params(fc_norm: bool, num_layers: int) -> dict[str, set[str]]:
    """SGLang's LlamaForCausalLMEagle3 parameters for a config with these fc_norm and num_hidden_layers."""
    upper = {k: v for i in range(1, num_layers) for k, v in sglang_upper_params(i).items()}
    return {**SGLANG_PARAMS, **(SGLANG_FC_NORM_PARAMS if fc_norm else {}), **upper}


def sglang_target(key: str, params: dict[str, set[str]] | None = None) -> tuple[str, str] | None:
    """(SGLang parameter, shard) that SGLang's Eagle3 load_weights writes `key` into; None if it skips the key.
    params: the parameters of the drafter's config (sglang_params); default one layer with fc_norm's norms."""
    params = params if params is not None else sglang_params(True, 1)
    shard = ""
    for ours, theirs, sid in SGLANG_STACKED:
        if ours in key:
            key, shard = key.replace(ours, theirs), sid
            break
    for name in (key, f"model.{key}"):
        if name in params:
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


def sglang_mla_params(fc_norm: bool, num_layers: int) -> dict[str, set[str]]:
    """SGLang's Eagle3DeepseekV2ForCausalLM parameters (it builds exactly one layer: check_supported refuses more)."""
    return {**SGLANG_MLA_PARAMS, **(SGLANG_FC_NORM_PARAMS if fc_norm else {})}


def sglang_mla_target(key: str, params: dict[str, set[str]] | None = None) -> tuple[str, str] | None:
    """(SGLang parameter, shard) that Eagle3DeepseekV2ForCausalLM.load_weights writes `key` into; None if skipped."""
    name = re.sub(r"^layers\.0\.", "midlayer.", key)
    name = name if name.startswith("lm_head.") else f"model.{name}"
    params = params if params is not None else sglang_mla_params(True, 1)
    for ours, theirs, sid in SGLANG_STACKED[3:]:  # gate/up only
        if ours in name and name.replace(ours, theirs) in params:
            return name.replace(ours, theirs), sid
    for part, sid in (("q_a_proj", "q_a"), ("kv_a_proj_with_mqa", "kv_a")):
        if part in name:
            return name.replace(part, "fused_qkv_a_proj_with_mqa"), sid
    return (name, "") if name in params else None


# architecture -> (its parameters for (fc_norm, num_layers), the loader's rule, the keys we export for them)
LAYOUTS = {
    LLAMA_EAGLE3: (sglang_params, sglang_target, export_keys),
    MLA_EAGLE3: (sglang_mla_params, sglang_mla_target, lambda fc_norm, num_layers: mla_export_keys(fc_norm)),
}


def check_keys(
    keys, where: str, fc_norm: bool | None = None, architecture: str | None = None, num_layers: int | None = None
) -> None:
    """Raise ValueError unless SGLang's loader reads every key, fills every parameter shard, and gets d2t/t2d.

    fc_norm: whether the drafter's config sets fc_norm (SGLang then has model.fc_norm.{i}); None infers it from the
    keys. architecture: the config's architectures[0]; None infers MLA from an MLA projection's key. num_layers: the
    config's num_hidden_layers; None infers it from the highest `layers.{i}.` key.
    """
    keys = set(keys)
    if fc_norm is None:
        fc_norm = any(k.startswith("fc_norm.") for k in keys)
    if architecture is None:
        mla = ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj")
        architecture = MLA_EAGLE3 if any(p in k for k in keys for p in mla) else LLAMA_EAGLE3
    if num_layers is None:
        num_layers = 1 + max((int(m[1]) for k in keys if (m := re.match(r"layers\.(\d+)\.", k))), default=0)
    if architecture not in LAYOUTS:
        raise ValueError(f"{where}: drafter architecture {architecture} is not one of {', '.join(LAYOUTS)}")
    layout_params, rule, expected_keys = LAYOUTS[architecture]
    params = layout_params(fc_norm, num_layers)

    def target(k: str) -> tuple[str, str] | None:
        return rule(k, params)

    filled = {target(k) for k in keys} - {None}
    unread = sorted(k for k in keys - {"d2t", "t2d"} if target(k) is None)
    unfilled = sorted(f"{p}[{s}]" if s else p for p, shards in params.items() for s in shards if (p, s) not in filled)
    missing = sorted({"d2t", "t2d"} - keys)
    expected = expected_keys(fc_norm, num_layers)
    if unread or unfilled or missing or keys != set(expected):
        raise ValueError(
            f"{where}: drafter keys do not load into SGLang's {architecture} (skipped silently: {unread}; "
            f"left unfilled: {unfilled}; missing: {missing}; expected exactly {sorted(expected)})"
        )


UPPER_NORM = re.compile(r"^layers\.(\d+)\.hidden_norm\.weight$")


def vllm_norm_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A deeper drafter's layers.{i} (i >= 1) norm their input with `hidden_norm` in SGLang 0.5.17
    (llama_eagle3.py: `self.hidden_norm(hidden_states, residual)` when not is_input_layer) and with `input_layernorm`
    in vLLM (its llama_eagle3.py: `self.input_layernorm(hidden_states, residual)` when layer_idx > 0); each engine
    loads both. The export writes the one weight under both names, so the drafter means the same in either."""
    return {
        f"layers.{m[1]}.input_layernorm.weight": v.clone() for k, v in tensors.items() if (m := UPPER_NORM.match(k))
    }


def drop_norm_copies(tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """`tensors` without the copies vllm_norm_copies writes, after checking each equals its hidden_norm."""
    out = dict(tensors)
    for k, v in tensors.items():
        if m := UPPER_NORM.match(k):
            copy = out.pop(f"layers.{m[1]}.input_layernorm.weight", None)
            if copy is not None and not torch.equal(copy, v):
                raise ValueError(
                    f"{where}: layers.{m[1]}.input_layernorm differs from its hidden_norm; SGLang norms that layer's "
                    "input with hidden_norm and vLLM with input_layernorm, so the drafter would differ between them"
                )
    return out


def drafter_tensors(state_dict: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """The exportable tensors of a (possibly wrapped) drafter state dict, keys without `prefix`."""
    out = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    out = {k: v.detach().cpu().contiguous() for k, v in out.items() if k not in IGNORED_KEYS}
    out.update(vllm_norm_copies(out))
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
    """config.json and model.safetensors into `folder`; NonFinite (nothing written) when a tensor holds NaN or inf."""
    check_keys(tensors, str(folder), cfg.fc_norm, cfg.architecture, cfg.num_hidden_layers)
    check_finite(tensors, str(folder))
    with disk_full(folder / CONFIG):
        (folder / CONFIG).write_text(json_text(cfg.to_hf_dict(), str(folder / CONFIG), indent=2) + "\n")
    with disk_full(folder / WEIGHTS):
        save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    as_umask_allows(folder / WEIGHTS)


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


def check_weight_shapes(folder: str | Path, cfg: DrafterConfig | None = None) -> None:
    """ValueError naming the file and the tensor when a weight's shape is not the one the folder's config.json gives
    it (torch and SGLang would stop with a size-mismatch traceback). Reads the files' headers only, the model is
    built on the meta device; a layout model.py cannot build (SGLang may still serve it) is not checked."""
    folder = Path(folder)
    cfg = cfg or DrafterConfig.from_json(folder / CONFIG)
    try:
        cfg.check_supported()
    except ValueError:
        return
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in new_drafter(cfg).state_dict().items()}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            for key in h.keys():
                name = key.removeprefix("model.")
                if cfg.architecture == MLA_EAGLE3:
                    name = re.sub(r"^layers\.0\.", "midlayer.", name)
                shape = tuple(h.get_slice(key).get_shape())
                if name in expected and shape != expected[name]:
                    raise ValueError(
                        f"{f}: tensor {key} has shape {list(shape)}, {folder / CONFIG} gives it {list(expected[name])}: "
                        "the config and the weights are not of one drafter"
                    )


def load_drafter(
    folder: str | Path, embedding: torch.Tensor | None = None, cfg: DrafterConfig | None = None
) -> Eagle3Drafter:
    """A drafter from SGLang's form (either layout: model_mla.py's new_drafter); `embedding` (V, H) is the
    target's input embedding; `cfg` the folder's config.json when already read (folder.py's DrafterFolder)."""
    folder = Path(folder)
    if cfg is None:
        if not (folder / CONFIG).is_file():
            raise FileNotFoundError(f"{folder}: no {CONFIG} (expected a drafter in SGLang's form)")
        cfg = DrafterConfig.from_json(folder / CONFIG)
    check_weight_shapes(folder, cfg)
    tensors = read_drafter_tensors(folder)
    if cfg.architecture == MLA_EAGLE3:  # SGLang's MLA loader reads checkpoints that name the midlayer layers.0
        tensors = {re.sub(r"^layers\.0\.", "midlayer.", k): v for k, v in tensors.items()}
    check_keys(tensors, str(folder), cfg.fc_norm, cfg.architecture, cfg.num_hidden_layers)
    tensors = drop_norm_copies(tensors, str(folder))
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
