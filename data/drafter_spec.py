"""The drafter's shape as the harvest needs it, read from an SGLang-form config.json.

Train and eval import this too; the raw dict stays available for everything else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """SGLang's default when the config names none: [1, L//2 - 1, L - 4]."""
    return [1, num_layers // 2 - 1, num_layers - 4]


@dataclass
class DrafterSpec:
    hidden_size: int
    target_hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int] | None  # None: SGLang's default, resolved by check_target()
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, path: str | Path, draft_vocab_size: int | None = None) -> "DrafterSpec":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"drafter config not found: {p}")
        raw = json.loads(p.read_text())
        try:
            hidden = int(raw["hidden_size"])
            vocab = int(raw["vocab_size"])
        except KeyError as e:
            raise ValueError(f"{p}: drafter config lacks {e.args[0]!r}") from None
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=hidden,
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            vocab_size=vocab,
            draft_vocab_size=int(draft_vocab_size or raw.get("draft_vocab_size") or vocab),
            aux_layer_ids=[int(i) for i in ids] if ids is not None else None,
            raw=raw,
        )

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> list[int]:
        """Raise ValueError naming both values when the target does not fit; return the aux layer ids."""
        if self.target_hidden_size != hidden_size:
            raise ValueError(f"drafter target_hidden_size {self.target_hidden_size} != target hidden_size {hidden_size}")
        if self.vocab_size != vocab_size:
            raise ValueError(f"drafter vocab_size {self.vocab_size} != target vocab_size {vocab_size}")
        if not 0 < self.draft_vocab_size <= vocab_size:
            raise ValueError(f"drafter draft_vocab_size {self.draft_vocab_size} not in (0, target vocab_size {vocab_size}]")
        ids = self.aux_layer_ids if self.aux_layer_ids is not None else default_aux_layer_ids(num_layers)
        if len(ids) != 3:
            raise ValueError(f"drafter aux layer ids {ids}: EAGLE-3 fuses exactly 3 layers")
        bad = [i for i in ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"drafter aux layer ids {bad} outside the target's layers 0..{num_layers - 1} (num_layers {num_layers})")
        return list(ids)
