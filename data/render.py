"""Prompt sets rendered with the target's tokenizer: `bench.prompts` (MT-Bench by default) and each
`bench.more_prompts`, the first user turn of each conversation through the target's chat template into token ids, so
every bench backend, and the offline τ on a bench's answers, read exactly the same tokens."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from eagle3ft.config import BenchConfig, SourceConfig, TargetConfig
from eagle3ft.data.chat import ChatFormat
from eagle3ft.data.prompts import collect


@dataclass
class PromptSet:
    label: str  # the source's kind; a repeated kind numbered (mtbench, mtbench-2)
    source: object  # its SourceConfig
    prompts: list[list[int]]  # token ids, generation prompt included


def load_prompts(target: TargetConfig, tokenizer, source: SourceConfig) -> list[list[int]]:
    """First user turn of each conversation of `source` (a SourceConfig), chat-templated into token ids."""
    convs = collect([source], max_turns=1, regenerate=True, heldout_fraction=0.0, dedupe=True, skips=Counter())
    chat = ChatFormat(tokenizer, target.chat_template)
    out = []
    for c in convs:
        first_user = next(i for i, m in enumerate(c.messages) if m["role"] == "user")
        ids, _ = chat.encode(c.messages[: first_user + 1], add_generation_prompt=True)
        out.append(ids)
    if not out:
        raise ValueError(f"bench prompts {source} gave no prompts")
    return out


def set_labels(bench: BenchConfig) -> list[tuple[str, object]]:
    """(label, source) of `bench.prompts`, then of each `bench.more_prompts`, labelled by kind (a repeated kind
    numbered)."""
    out: list[tuple[str, object]] = []
    for src in [bench.prompts, *bench.more_prompts]:
        label, n = src.kind, 2
        while label in dict(out):
            label, n = f"{src.kind}-{n}", n + 1
        out.append((label, src))
    return out


def load_prompt_sets(target: TargetConfig, bench: BenchConfig, tokenizer) -> list[PromptSet]:
    """Every prompt set of the config, `bench.prompts` first, rendered with `tokenizer` (the target's)."""
    return [PromptSet(label, src, load_prompts(target, tokenizer, src)) for label, src in set_labels(bench)]
