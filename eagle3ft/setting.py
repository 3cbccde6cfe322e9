"""One speculation setting: SGLang's --speculative-num-steps / -eagle-topk / -num-draft-tokens.

The config's `bench.settings` and `serve.harvest_setting` hold it, the cost model prices it (eval/economics/cost_model.py), and
its `key` ("3/1/4") names it in every file the bench and the economics write.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3ft.config_build import ConfigError, positive


@dataclass(frozen=True)
class Setting:
    """Steps drafted per cycle, tree branching (1 = chain), tokens verified per cycle."""

    steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4

    def __post_init__(self) -> None:
        positive(self, "steps", "topk", "num_draft_tokens")

    @property
    def key(self) -> str:
        return f"{self.steps}/{self.topk}/{self.num_draft_tokens}"

    @classmethod
    def parse(cls, text: str) -> Setting:
        """'3/1/4' -> steps 3, topk 1, num_draft_tokens 4."""
        try:
            steps, topk, ndt = (int(x) for x in text.split("/"))
        except ValueError:
            raise ConfigError(f"setting {text!r}: expected steps/topk/num_draft_tokens, e.g. 3/1/4") from None
        return cls(steps, topk, ndt)

    @classmethod
    def of(cls, obj: Setting | dict | str) -> Setting:
        """A Setting from itself, its key ("3/1/4") or its fields as a dict (summary.json's "setting")."""
        if isinstance(obj, Setting):
            return obj
        if isinstance(obj, str):
            return cls.parse(obj)
        return cls(int(obj["steps"]), int(obj["topk"]), int(obj["num_draft_tokens"]))
