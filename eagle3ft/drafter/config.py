"""The drafter's config: SGLang's ``LlamaForCausalLMEagle3`` config.json, read and written here only, and the one check
of a drafter against a target or a feature store.

`DrafterConfig` is what every stage knows of a drafter: the harvest takes the aux layer ids and the vocab sizes from
it, train builds the model from it (model.py), eval checks a checkpoint with it. Reading is lenient about the
layout (SGLang serves drafters that model.py cannot build); `check_supported()` refuses those before a model is
built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3ft.drafter.vocab import check_vocab
from eagle3ft.files import read_json_object

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# On a Llama target SGLang's aux id i is the output of decoder layer i; vLLM's id j is the hidden state entering
# layer j (0: the embeddings), read only from the top-level `eagle_aux_hidden_state_layer_ids` (vllm 0.19.1:
# v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config; captured in models/llama.py LlamaModel.forward and
# models/deepseek_v2.py DeepseekV2Model.forward). There the same layer is j = i + 1, and so are the two defaults:
# SGLang's [1, L//2 - 1, L - 4], vLLM's (2, L//2, L - 3) (models/interfaces.py, models/deepseek_v2.py). On a
# DeepSeek-V3 target SGLang may take id i as given (SGLANG_AS_GIVEN_CAPTURE): capture_points gives vLLM's ids.
VLLM_AUX_ID_OFFSET = 1
# Targets whose SGLang 0.5.17 class inherits DeepseekV2ForCausalLM.set_eagle3_layers_to_capture (models/deepseek_v2.py,
# kimi_k25.py, mistral_large_3.py, glm4_moe.py's DSA model). It adds 1 to the ids only when the first id is 1, and
# otherwise captures the state entering layer i, i.e. the output of layer i - 1 (for id 0: the embeddings): on a
# DeepSeek-V3 target served by SGLang, ids [0, 1, 2] return the embeddings and the outputs of layers 0 and 1. So
# AQ-MedAI's [2, 30, 58] and SGLang's default [1, 29, 57] name the same three states of Kimi-K2.
SGLANG_AS_GIVEN_CAPTURE = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "KimiK25ForConditionalGeneration",
    "MistralLarge3ForCausalLM",
    "GlmMoeDsaForCausalLM",
)
LLAMA_EAGLE3 = "LlamaForCausalLMEagle3"  # SGLang's models/llama_eagle3.py: model.py
MLA_EAGLE3 = "Eagle3DeepseekV2ForCausalLM"  # SGLang's models/kimi_k25_eagle3.py (DeepSeek-V2 MLA): model_mla.py


class DrafterMismatch(ValueError):
    """A drafter that does not fit the target or the features it is used with; the message names both values."""


def capture_points(target_architectures: list[str] | None, aux_layer_ids) -> list[int]:
    """Where SGLang 0.5.17 takes each aux id's rows on this target, as an index of transformers' hidden_states
    (0: the embeddings, k: the output of decoder layer k - 1); vLLM's top-level ids count the same way."""
    ids = [int(i) for i in aux_layer_ids]
    as_given = any(a in SGLANG_AS_GIVEN_CAPTURE for a in target_architectures or ())
    if as_given and not (ids and ids[0] == 1):
        return ids
    return [i + 1 for i in ids]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """SGLang's default when the config names none: [1, L//2 - 1, L - 4]."""
    return [1, num_layers // 2 - 1, num_layers - 4]


@dataclass
class DrafterConfig:
    """The drafter architecture, read from / written to SGLang's config.json form."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int | None = None  # defaults to hidden_size
    head_dim: int | None = None  # defaults to hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope_scaling / rope_parameters (rope_type + its fields)
    max_position_embeddings: int = 4096
    aux_layer_ids: list[int] | None = None  # eagle_config.eagle_aux_hidden_state_layer_ids; None: SGLang's default
    # the top-level eagle_aux_hidden_state_layer_ids, vLLM's ids of the same layers: capture_points on the target
    # (train/build.py sets them from the target); None writes i + 1, a Llama target's
    vllm_aux_layer_ids: list[int] | None = None
    hidden_act: str = "silu"
    fc_norm: bool = False  # EAGLE-3.1: one RMSNorm per aux layer on its chunk before fc (legacy name use_aux_norm)
    norm_output: bool = False  # EAGLE-3.1: the next draft step is fed the hidden state after the final norm
    # decoder layers: the midlayer, then (Llama layout only) layers 1.. as SGLang 0.5.17's llama_eagle3.py builds them
    # (layers.0 reads the 2H input, later ones H with hidden_norm before their attention): model.py's UpperLayer
    num_hidden_layers: int = 1
    tie_word_embeddings: bool = False  # an EAGLE-3 drafter has its own lm_head; True is refused
    architecture: str = LLAMA_EAGLE3  # architectures[0]: the layout (MLA_EAGLE3 keeps its MLA keys in `extra`)
    extra: dict[str, Any] = field(default_factory=dict)  # other config.json keys, kept on export
    path: str = field(default="drafter config", repr=False, compare=False)  # where it was read from (in errors)

    _KNOWN = (
        "hidden_size num_attention_heads num_key_value_heads intermediate_size vocab_size draft_vocab_size "
        "target_hidden_size head_dim rms_norm_eps rope_theta rope_scaling rope_parameters max_position_embeddings "
        "hidden_act num_hidden_layers architectures tie_word_embeddings fc_norm use_aux_norm norm_output "
        "eagle_aux_hidden_state_layer_ids"
    ).split()

    def __post_init__(self) -> None:
        self.target_hidden_size = self.target_hidden_size or self.hidden_size
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    # -- config.json

    @classmethod
    def from_json(cls, path: str | Path, draft_vocab_size: int | None = None) -> "DrafterConfig":
        """The one reader of a drafter's config.json; draft_vocab_size, when given, overrides the file's."""
        return cls.from_dict(read_json_object(path, "drafter config"), draft_vocab_size, str(path))

    @classmethod
    def from_dict(cls, d: dict, draft_vocab_size: int | None = None, path: str = "drafter config") -> "DrafterConfig":
        try:
            hidden = int(d["hidden_size"])
            vocab = int(d["vocab_size"])
            ids = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            top = d.get("eagle_aux_hidden_state_layer_ids")
            if ids is None and top is not None:  # vLLM's form alone
                ids = [int(j) - VLLM_AUX_ID_OFFSET for j in top]
            rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
            theta = d.get("rope_theta", rope.pop("rope_theta", 10000.0))
            rope.pop("rope_theta", None)
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = {}
            return cls(
                hidden_size=hidden,
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
                intermediate_size=d["intermediate_size"],
                vocab_size=vocab,
                draft_vocab_size=int(draft_vocab_size or d.get("draft_vocab_size") or vocab),
                target_hidden_size=int(d.get("target_hidden_size") or hidden),
                head_dim=d.get("head_dim"),
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                rope_scaling=rope or None,
                max_position_embeddings=d.get("max_position_embeddings", 4096),
                aux_layer_ids=[int(i) for i in ids] if ids is not None else None,
                vllm_aux_layer_ids=[int(j) for j in top] if top is not None else None,
                hidden_act=d.get("hidden_act", "silu"),
                fc_norm=bool(d.get("fc_norm") or d.get("use_aux_norm")),
                norm_output=bool(d.get("norm_output")),
                num_hidden_layers=d.get("num_hidden_layers", 1),
                tie_word_embeddings=bool(d.get("tie_word_embeddings")),
                architecture=(d.get("architectures") or [LLAMA_EAGLE3])[0],
                extra={k: v for k, v in d.items() if k not in cls._KNOWN},
                path=path,
            )
        except KeyError as e:
            raise ValueError(f"{path}: drafter config lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: drafter config has a value of the wrong type ({e})") from None

    def to_hf_dict(self) -> dict:
        """SGLang's config.json for the drafter's architecture."""
        d = {
            **self.extra,
            "architectures": [self.architecture],
            "model_type": self.extra.get("model_type", "llama"),
            "hidden_size": self.hidden_size,
            "target_hidden_size": self.target_hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.rope_scaling:
            d["rope_scaling"] = dict(self.rope_scaling)
        if self.fc_norm:
            d["fc_norm"] = True
        if self.norm_output:
            d["norm_output"] = True
        if self.aux_layer_ids is not None:  # None: each server's default, which name the same layers
            d["eagle_config"] = {
                **self.extra.get("eagle_config", {}),
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            }
            d["eagle_aux_hidden_state_layer_ids"] = list(
                self.vllm_aux_layer_ids or [i + VLLM_AUX_ID_OFFSET for i in self.aux_layer_ids]
            )
        return d

    # -- checks

    def check_supported(self) -> "DrafterConfig":
        """Raise ValueError for a layout that model.py cannot build (SGLang may still serve it); returns self."""
        if self.num_hidden_layers < 1 or (self.num_hidden_layers != 1 and self.architecture != LLAMA_EAGLE3):
            raise ValueError(
                f"drafter num_hidden_layers is {self.num_hidden_layers}; this trainer builds 1 decoder layer or more "
                f"for {LLAMA_EAGLE3}, 1 for {self.architecture}"
            )
        if self.tie_word_embeddings:
            raise ValueError(
                "drafter tie_word_embeddings is true; an EAGLE-3 drafter has its own lm_head over the draft vocab"
            )
        if self.extra.get("bias") or (self.extra.get("eagle_config") or {}).get("norm_before_fc"):
            raise ValueError(
                "drafter config sets bias or eagle_config.norm_before_fc; "
                "only fc_norm and norm_output of those layouts are supported"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"drafter hidden_act '{self.hidden_act}' is not supported (only silu)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type '{rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        return self

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> list[int]:
        """check_drafter against a live target (it has no aux ids of its own), named by where the config was read."""
        return check_drafter(
            self, {"hidden_size": hidden_size, "vocab_size": vocab_size, "num_layers": num_layers}, self.path
        )


def check_drafter(
    drafter: DrafterConfig,
    target: dict,
    where: str,
    features: str | None = None,
    d2t: torch.Tensor | None = None,
    t2d: torch.Tensor | None = None,
) -> list[int]:
    """The one check of a drafter against a target or a feature store; train, eval, the bench and the harvest call it
    before any compute. Returns the aux layer ids (SGLang's default when the drafter names none).

    target: hidden_size, vocab_size, num_layers, and aux_layer_ids when it describes features.
    features: the feature store's manifest when `target` is its identity (named in the messages), else None.
    d2t/t2d: the drafter's draft vocabulary, checked for range and consistency when given.
    """
    other = "features' target" if features else "target"
    tail = f" ({features})" if features else ""
    if drafter.target_hidden_size != target["hidden_size"]:
        raise DrafterMismatch(
            f"{where}: drafter target_hidden_size {drafter.target_hidden_size} "
            f"!= {other} hidden_size {target['hidden_size']}{tail}"
        )
    if drafter.vocab_size != target["vocab_size"]:
        raise DrafterMismatch(
            f"{where}: drafter vocab_size {drafter.vocab_size} != {other} vocab_size {target['vocab_size']}{tail}"
        )
    if not 0 < drafter.draft_vocab_size <= target["vocab_size"]:
        raise DrafterMismatch(
            f"{where}: drafter draft_vocab_size {drafter.draft_vocab_size} "
            f"not in (0, {other} vocab_size {target['vocab_size']}]{tail}"
        )
    num_layers = target["num_layers"]
    ids = list(drafter.aux_layer_ids) if drafter.aux_layer_ids is not None else default_aux_layer_ids(num_layers)
    if len(ids) != 3:
        raise DrafterMismatch(f"{where}: drafter aux layer ids {ids}: EAGLE-3 fuses exactly 3 layers")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise DrafterMismatch(
            f"{where}: drafter aux layer ids {bad} outside the {other}'s layers 0..{num_layers - 1} "
            f"(num_layers {num_layers}){tail}"
        )
    if target.get("aux_layer_ids") is not None and ids != list(target["aux_layer_ids"]):
        raise DrafterMismatch(
            f"{where}: drafter aux layer ids {ids} != {'features' if features else 'target'}' "
            f"aux layer ids {list(target['aux_layer_ids'])}{tail}"
        )
    if d2t is not None or t2d is not None:
        check_vocab(d2t, t2d, target["vocab_size"], drafter.draft_vocab_size, f"{where}: draft vocabulary")
    return ids
