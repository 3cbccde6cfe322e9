"""The drafter's shape, read from an SGLang-form config.json, and the one check of a drafter against a target.

DrafterSpec.from_json is the one reader of a drafter's config.json: the harvest, train and eval import it, and
train/model.py's Eagle3Config is built from it (the raw dict carries the architecture's other keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3ft.files import read_json
from eagle3ft.vocab import check_vocab, vocab_from_drafter


class DrafterMismatch(ValueError):
    """A drafter that does not fit the target or the features it is used with; the message names both values."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """SGLang's default when the config names none: [1, L//2 - 1, L - 4]."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def check_drafter(
    drafter,
    target: dict,
    where: str,
    features: str | None = None,
    d2t: torch.Tensor | None = None,
    t2d: torch.Tensor | None = None,
) -> list[int]:
    """The one check of a drafter against a target or a feature store; train, eval, the bench and the harvest call it
    before any compute. Returns the aux layer ids (SGLang's default when the drafter names none).

    drafter: anything with target_hidden_size, vocab_size, draft_vocab_size, aux_layer_ids (DrafterSpec, Eagle3Config).
    target: hidden_size, vocab_size, num_layers, and aux_layer_ids when it describes features.
    features: the feature store's manifest when `target` is its identity (named in the messages), else None.
    d2t/t2d: the drafter's draft vocabulary, checked for range and consistency when given.
    """
    other = "features' target" if features else "target"
    tail = f" ({features})" if features else ""
    if drafter.target_hidden_size != target["hidden_size"]:
        raise DrafterMismatch(
            f"{where}: drafter target_hidden_size {drafter.target_hidden_size} != {other} hidden_size {target['hidden_size']}{tail}"
        )
    if drafter.vocab_size != target["vocab_size"]:
        raise DrafterMismatch(
            f"{where}: drafter vocab_size {drafter.vocab_size} != {other} vocab_size {target['vocab_size']}{tail}"
        )
    if not 0 < drafter.draft_vocab_size <= target["vocab_size"]:
        raise DrafterMismatch(
            f"{where}: drafter draft_vocab_size {drafter.draft_vocab_size} not in (0, {other} vocab_size {target['vocab_size']}]{tail}"
        )
    num_layers = target["num_layers"]
    ids = list(drafter.aux_layer_ids) if drafter.aux_layer_ids is not None else default_aux_layer_ids(num_layers)
    if len(ids) != 3:
        raise DrafterMismatch(f"{where}: drafter aux layer ids {ids}: EAGLE-3 fuses exactly 3 layers")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise DrafterMismatch(
            f"{where}: drafter aux layer ids {bad} outside the {other}'s layers 0..{num_layers - 1} (num_layers {num_layers}){tail}"
        )
    if target.get("aux_layer_ids") is not None and ids != list(target["aux_layer_ids"]):
        raise DrafterMismatch(
            f"{where}: drafter aux layer ids {ids} != {'features' if features else 'target'}' aux layer ids {list(target['aux_layer_ids'])}{tail}"
        )
    if d2t is not None or t2d is not None:
        check_vocab(d2t, t2d, target["vocab_size"], drafter.draft_vocab_size, f"{where}: draft vocabulary")
    return ids


@dataclass
class DrafterSpec:
    hidden_size: int
    target_hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int] | None  # None: SGLang's default, resolved by check_target()
    raw: dict = field(default_factory=dict, repr=False)
    path: str = "drafter config"  # where it was read from (named in errors)

    @classmethod
    def from_json(cls, path: str | Path, draft_vocab_size: int | None = None) -> "DrafterSpec":
        """The one reader of a drafter's config.json; train's Eagle3Config is built from what it returns."""
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"drafter config not found: {p}")
        raw = read_json(p, "the drafter config")
        if not isinstance(raw, dict):
            raise ValueError(f"{p}: the drafter config is not a JSON object")
        return cls.from_dict(raw, draft_vocab_size, str(p))

    @classmethod
    def from_dict(cls, raw: dict, draft_vocab_size: int | None = None, path: str = "drafter config") -> "DrafterSpec":
        try:
            hidden = int(raw["hidden_size"])
            vocab = int(raw["vocab_size"])
            ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            return cls(
                hidden_size=hidden,
                target_hidden_size=int(raw.get("target_hidden_size") or hidden),
                vocab_size=vocab,
                draft_vocab_size=int(draft_vocab_size or raw.get("draft_vocab_size") or vocab),
                aux_layer_ids=[int(i) for i in ids] if ids is not None else None,
                raw=raw,
                path=path,
            )
        except KeyError as e:
            raise ValueError(f"{path}: drafter config lacks {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: drafter config has a value of the wrong type ({e})") from None

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> list[int]:
        """Raise DrafterMismatch naming both values when the target does not fit; return the aux layer ids."""
        return check_drafter(
            self, {"hidden_size": hidden_size, "vocab_size": vocab_size, "num_layers": num_layers}, self.path
        )


def check_drafter_folder(folder: str | Path, target: dict, where: str, features: str | None = None) -> DrafterSpec:
    """check_drafter for a drafter folder in SGLang's form (config.json + *.safetensors with its d2t/t2d), read
    without loading the weights: a truncated weights file, a mismatch or an inconsistent vocab is named here."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{where}: {folder} has no config.json (expected a drafter in SGLang's form)")
    spec = DrafterSpec.from_json(folder / "config.json")
    check_drafter(spec, target, f"{where} {folder}", features)
    d2t, t2d = vocab_from_drafter(folder)
    check_drafter(spec, target, f"{where} {folder}", features, d2t, t2d)
    return spec
