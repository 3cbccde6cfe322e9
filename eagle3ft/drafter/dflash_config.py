"""A DFlash block drafter's config: SGLang 0.5.17's ``DFlashDraftModel`` config.json, read and written here only.

SGLang reads the draft's layout from the usual Qwen3 fields and the DFlash fields from `dflash_config` (which wins
over a top-level key for num_target_layers, block_size and target_layer_ids; mask_token and mask_token_id are read
from `dflash_config` only): speculative/dflash_utils.py parse_dflash_draft_config, models/dflash.py. Reading refuses
what SGLang refuses (a non-silu activation, an empty or out-of-range id list, a negative mask id) and what
dflash_model.py cannot build (sliding or causal layers, attention bias, GPT-J rope); `check_target` refuses a target it
does not fit (hidden size, a mask id outside the vocabulary, a layer id SGLang never captures).

Target layer id j is the output of target decoder layer j (transformers' hidden_states[j + 1]); the K features are
concatenated in ascending id order, so ids must be sorted and unique, and at most T - 2 (SGLang never captures the
last layer's output: its capture point T is past the last layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any

from eagle3ft.files import read_json_object

DFLASH = "DFlashDraftModel"  # SGLang's models/dflash.py EntryClass (the generic one; Laguna's is another layout)
ROPE_TYPES = ("default", "yarn")  # dflash_model.rope_cos_sin builds these as SGLang does


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """SGLang's build_target_layer_ids (dflash_utils.py 268-305): [T // 2] for one draft layer, else L_d ids spread
    evenly (Python round) over [1, T - 3]."""
    if num_target_layers <= 0 or num_draft_layers <= 0:
        raise ValueError(f"layer counts must be positive, got {num_target_layers} and {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"DFlash's default layer ids need a target of >= 4 layers, got {num_target_layers}")
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DFlashConfig:
    """The DFlash draft architecture (Qwen3-style layers, no embedding, no LM head) and its DFlash fields."""

    hidden_size: int  # = the target's hidden size (the draft reads the target's embedding and feeds its LM head)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int  # draft depth L_d
    num_target_layers: int  # T, the target's decoder layers (SGLang resolves default ids from it)
    target_layer_ids: list[int]  # K ids, "output of target layer j", ascending
    mask_token_id: int | None = None  # None: SGLang looks `mask_token` up in the tokenizer (or adds it)
    block_size: int = 16  # B: the bonus token + B - 1 drafted tokens
    mask_token: str | None = None  # dflash_config.mask_token, kept as read
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # rope_type + its fields, as SGLang's get_rope reads them
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    vocab_size: int | None = None  # the target's vocabulary, informational (SGLang checks the mask id against it)
    extra: dict[str, Any] = field(default_factory=dict)  # other config.json keys, written back unchanged
    dflash_extra: dict[str, Any] = field(default_factory=dict)  # other dflash_config keys, written back unchanged
    path: str = field(default="DFlash config", repr=False, compare=False)

    _KNOWN = (
        "architectures model_type hidden_size num_attention_heads num_key_value_heads head_dim intermediate_size "
        "num_hidden_layers num_target_layers target_layer_ids block_size dflash_config rms_norm_eps rope_theta "
        "rope_scaling rope_parameters max_position_embeddings hidden_act vocab_size layer_types attention_bias "
        "rope_is_neox_style is_neox_style is_causal"
    ).split()
    _DFLASH_KNOWN = ("num_target_layers", "target_layer_ids", "block_size", "mask_token_id", "mask_token")

    def __post_init__(self) -> None:
        self.check()

    @property
    def num_features(self) -> int:
        """K, the number of target layers whose outputs are concatenated per token."""
        return len(self.target_layer_ids)

    def hidden_state_indices(self) -> list[int]:
        """Where each feature is in transformers' output_hidden_states (0: the embeddings): j + 1 for every id, on
        every target. SGLang's set_dflash_layers_to_capture adds the same 1 on Llama and DeepseekV2 alike (unlike the
        EAGLE-3 hook on DeepseekV2, eagle3ft.drafter.config.capture_points)."""
        return [j + 1 for j in self.target_layer_ids]

    def eagle3_capture_ids(self, target_architectures: list[str] | None) -> list[int] | None:
        """The ids that make SGLang's EAGLE3 capture (an EAGLE3 server's draft config, or 0.5.23's aux capture with
        the EAGLE3 convention) take this drafter's features on this target, or None where no list does. A Llama's
        EAGLE3 hook adds 1 to every id as the DFlash hook does, so the ids carry over; a DeepseekV2's adds 1 only when
        the first id is 1 and else captures layer inputs, so [1, ...] carries over, ids from 2 up shift by one, and
        a list starting at layer 0's output cannot be asked for (models/llama.py:885-909, deepseek_v2.py:3134-3161)."""
        from eagle3ft.drafter.config import capture_points

        want = self.hidden_state_indices()
        for ids in (list(self.target_layer_ids), [j + 1 for j in self.target_layer_ids]):
            if capture_points(target_architectures, ids) == want:
                return ids
        return None

    def eagle3_capture_ids_on_any_target(self) -> list[int] | None:
        """eagle3_capture_ids where it is the same list on a Llama and a DeepseekV2 (ids starting at 1), else None."""
        llama, deepseek = self.eagle3_capture_ids(None), self.eagle3_capture_ids(["DeepseekV3ForCausalLM"])
        return llama if llama == deepseek else None

    # -- config.json

    @classmethod
    def from_json(cls, path: str | Path) -> "DFlashConfig":
        return cls.from_dict(read_json_object(path, "DFlash config"), str(path))

    @classmethod
    def from_dict(cls, d: dict, path: str = "DFlash config") -> "DFlashConfig":
        arch = (d.get("architectures") or [None])[0]
        if arch != DFLASH:
            raise ValueError(f"{path}: architectures[0] is {arch!r}, a DFlash drafter is {DFLASH!r}")
        dc = d.get("dflash_config") or {}
        if not isinstance(dc, dict):
            raise ValueError(f"{path}: dflash_config must be an object, got {type(dc).__name__}")
        _refuse_layout(d, path)
        try:
            layers = _int(d["num_hidden_layers"], "num_hidden_layers", path, 1)
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            target_layers = dc.get("num_target_layers", d.get("num_target_layers"))
            if target_layers is None:
                raise ValueError(f"{path}: num_target_layers is required (SGLang would count the draft's layers)")
            target_layers = _int(target_layers, "num_target_layers", path, 1)
            ids = dc.get("target_layer_ids", d.get("target_layer_ids"))
            if ids is None:
                ids = default_target_layer_ids(target_layers, layers)
            elif not isinstance(ids, (list, tuple)):
                raise ValueError(f"{path}: dflash_config.target_layer_ids must be a list of ints, got {ids!r}")
            mask_id = dc.get("mask_token_id")
            if mask_id is not None and (not isinstance(mask_id, Integral) or isinstance(mask_id, bool)):
                raise ValueError(f"{path}: dflash_config.mask_token_id must be an integer, got {mask_id!r}")
            rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
            theta = d.get("rope_theta", rope.pop("rope_theta", 10000.0))
            rope.pop("rope_theta", None)
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = {}
            block = dc.get("block_size", d.get("block_size", 16))
            return cls(
                hidden_size=hidden,
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                head_dim=int(d.get("head_dim") or hidden // heads),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=layers,
                num_target_layers=target_layers,
                target_layer_ids=[int(i) for i in ids],
                mask_token_id=None if mask_id is None else int(mask_id),
                block_size=_int(block, "block_size", path, 1),
                mask_token=dc.get("mask_token"),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=rope or None,
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                hidden_act=d.get("hidden_act", "silu"),
                vocab_size=None if d.get("vocab_size") is None else int(d["vocab_size"]),
                extra={k: v for k, v in d.items() if k not in cls._KNOWN},
                dflash_extra={k: v for k, v in dc.items() if k not in cls._DFLASH_KNOWN},
                path=path,
            )
        except KeyError as e:
            raise ValueError(f"{path}: DFlash config lacks {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"{path}: DFlash config has a value of the wrong type ({e})") from None

    def to_hf_dict(self) -> dict:
        """SGLang's config.json: Qwen3 fields, the DFlash fields both at the top and in dflash_config, every layer
        full (bidirectional) attention."""
        dc = {"target_layer_ids": list(self.target_layer_ids), "block_size": self.block_size}
        dc["num_target_layers"] = self.num_target_layers
        if self.mask_token_id is not None:
            dc["mask_token_id"] = self.mask_token_id
        if self.mask_token is not None:
            dc["mask_token"] = self.mask_token
        d = {
            **self.extra,
            "architectures": [DFLASH],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {**self.dflash_extra, **dc},
        }
        if self.rope_scaling:
            d["rope_scaling"] = dict(self.rope_scaling)
        if self.vocab_size is not None:
            d["vocab_size"] = self.vocab_size
        return d

    # -- checks

    def check(self) -> None:
        """What SGLang refuses at load, and what dflash_model.py cannot build."""
        w = self.path
        if self.hidden_act != "silu":  # models/dflash.py 269-273
            raise ValueError(f"{w}: hidden_act {self.hidden_act!r}: SGLang's DFlash MLP takes silu only")
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{w}: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{w}: {self.num_attention_heads} heads do not split into {self.num_key_value_heads}")
        ids, T = self.target_layer_ids, self.num_target_layers
        if not ids:  # dflash_utils.py 435-439, 494-498
            raise ValueError(f"{w}: dflash_config.target_layer_ids must be non-empty")
        if any(j < 0 or j >= T for j in ids):  # dflash_utils.py 440-445
            raise ValueError(f"{w}: target_layer_ids {ids} out of range for {T} target layers")
        if any(j > T - 2 for j in ids):
            raise ValueError(
                f"{w}: target_layer_ids {ids}: id {T - 1} (the last layer's output) is never captured by SGLang; "
                f"ids must be <= {T - 2}"
            )
        if list(ids) != sorted(set(ids)):
            raise ValueError(f"{w}: target_layer_ids {ids} must be sorted and unique (features concatenate ascending)")
        if self.block_size < 2:
            raise ValueError(f"{w}: block_size {self.block_size} drafts nothing; it must be >= 2")
        if self.mask_token_id is not None and self.mask_token_id < 0:  # dflash_utils.py 517-521
            raise ValueError(f"{w}: dflash_config.mask_token_id must be non-negative, got {self.mask_token_id}")
        if self.vocab_size is not None:
            self.check_mask(self.vocab_size)
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"{w}: rope type {kind!r} is not built here (one of {ROPE_TYPES})")

    def check_mask(self, vocab_size: int) -> None:
        """SGLang refuses a mask id outside the target's vocabulary (dflash_worker_v2.py 733-742)."""
        if self.mask_token_id is not None and self.mask_token_id >= vocab_size:
            raise ValueError(
                f"{self.path}: dflash_config.mask_token_id {self.mask_token_id} is outside the target vocabulary "
                f"({vocab_size}); SGLang cannot resize the target's embedding"
            )

    def check_target(
        self, hidden_size: int, vocab_size: int, num_layers: int, context_length: int | None = None
    ) -> None:
        """The drafter against a target: its hidden size, vocabulary, layer count and (when given) context length,
        which SGLang refuses to exceed the draft's max_position_embeddings (configs/model_config.py 771-791)."""
        if context_length is not None and context_length > self.max_position_embeddings:
            raise ValueError(
                f"{self.path}: max_position_embeddings {self.max_position_embeddings} < the target's context "
                f"{context_length}; SGLang refuses to start (SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN aside)"
            )
        if hidden_size != self.hidden_size:
            raise ValueError(f"{self.path}: hidden_size {self.hidden_size} != the target's {hidden_size}")
        if num_layers != self.num_target_layers:
            raise ValueError(f"{self.path}: num_target_layers {self.num_target_layers} != the target's {num_layers}")
        self.check_mask(vocab_size)


def _int(v, name: str, path: str, lo: int) -> int:
    """SGLang's _parse_optional_int (dflash_utils.py 379-394) for a present value."""
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: invalid {name}={v!r}") from None
    if n < lo:
        raise ValueError(f"{path}: {name} must be >= {lo}, got {n}")
    return n


def _refuse_layout(d: dict, path: str) -> None:
    """Layouts SGLang serves that dflash_model.py does not build: sliding or causal layers, attention bias, GPT-J rope."""
    types = (d.get("text_config") or {}).get("layer_types", d.get("layer_types"))
    if types is None and d.get("use_sliding_window") and d.get("sliding_window", 4096) is not None:
        # transformers' Qwen3Config, which SGLang reads the file through, fills layer_types from these
        first = int(d.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(int(d["num_hidden_layers"]))]
    if types is not None:
        if isinstance(types, str) or not isinstance(types, (list, tuple)):
            raise ValueError(f"{path}: layer_types must be a list of attention types")  # dflash_utils.py 313-316
        if len(types) != int(d.get("num_hidden_layers", len(types))):
            raise ValueError(f"{path}: layer_types needs one entry per draft layer, got {len(types)}")
        if any(t != "full_attention" for t in types):
            raise ValueError(f"{path}: layer_types {list(types)}: only full_attention layers are built here")
    if d.get("is_causal"):
        raise ValueError(f"{path}: is_causal layers are not built here (DFlash blocks are bidirectional)")
    if d.get("attention_bias"):
        raise ValueError(f"{path}: attention_bias is not built here")
    if not d.get("rope_is_neox_style", d.get("is_neox_style", True)):
        raise ValueError(f"{path}: GPT-J style rope is not built here")
