"""What a live bench backend is: the interface the schedule drives, the result of one request, and the drafters of a
bench (`bench_drafters`: eval.checkpoint and bench.drafters, each a DrafterFolder read once).

    class BenchBackend(Protocol):
        name: str
        tokenizer            the target's: the caller renders the prompts with it (data/render.py)
        def run_baseline(self, prompts: list[list[int]], max_new_tokens: int, first_index: int = 0)
            -> list[RequestResult]
        def run_speculative(
            self, prompts: list[list[int]], setting: Setting, max_new_tokens: int, first_index: int = 0
        ) -> list[RequestResult]
        def environment(self) -> dict
    optional:
        def verify_costs(self, prompt: list[int], sizes: list[int]) -> dict[int, float]
            seconds of one target forward of n tokens after `prompt` (the economics' verify curve)
        def offline_tau(self, prompts, answers, settings) -> dict | None
            the drafter's offline tau on the prompts and the plain pass's answers (summary's
            offline_same_prompts: offline and live tau on the same tokens; greedy benches only)
        def use_drafter(self, label: str) -> None
            several drafters in one run (eval.checkpoint and bench.drafters): the one the next passes use

`prompts` are token ids (chat template applied, generation prompt included), prompts[k] being prompt number
first_index + k of the set (its RequestResult's prompt_index); decoding follows `bench.temperature` and stops at the
template's end-of-turn/eos ids or at max_new_tokens. A RequestResult's decode_s is the time after the first new token
until the last one, so tok/s = (new_tokens - 1) / decode_s for both kinds of pass; speculative results carry the
verify count and the tokens emitted per verify (bonus included, SGLang's spec_accept_length); timings per verify /
draft forward / cycle where the backend can see them (None otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from eagle3ft.config import BenchConfig, EvalConfig, resolve_path
from eagle3ft.drafter.folder import DrafterFolder
from eagle3ft.setting import Setting


@dataclass
class RequestResult:
    prompt_index: int
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float  # after the first new token until the last
    output_ids: list[int] | None = None
    verify_count: int | None = None
    accept_lengths: list[int] | None = None  # tokens emitted per verify, bonus included
    verify_s: list[float] | None = None
    draft_forward_s: list[float] | None = None
    cycle_s: list[float] | None = None
    wall_s: float | None = None  # the request sent -> its answer complete: prefill and transport included
    finished: bool | None = None  # stopped on a stop id before max_new_tokens
    events: list[list[float]] | None = None  # streamed: [seconds after the first token, tokens so far] per event
    whole: dict | None = None  # sglang: the same prompt's non-streamed request: new_tokens, wall_s, output_ids, ...

    @property
    def tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0


@runtime_checkable
class BenchBackend(Protocol):
    name: str
    tokenizer: Any

    def run_baseline(
        self, prompts: list[list[int]], max_new_tokens: int, first_index: int = 0
    ) -> list[RequestResult]: ...

    def run_speculative(
        self, prompts: list[list[int]], setting: Setting, max_new_tokens: int, first_index: int = 0
    ) -> list[RequestResult]: ...

    def environment(self) -> dict: ...


def bench_drafters(
    ev: EvalConfig, bench: BenchConfig, run_dir: Path, labels: list[str] | None = None
) -> dict[str, DrafterFolder]:
    """label -> drafter folder, each read once: eval.checkpoint (relative to the run, labelled as written) and
    bench.drafters (relative to the repository); with `labels`, only those."""
    folders = {}
    for label in labels if labels is not None else [ev.checkpoint, *bench.drafters]:
        if label == ev.checkpoint:
            folders[label] = DrafterFolder.of_run(run_dir, ev.checkpoint)
        else:
            folders[label] = DrafterFolder(resolve_path(bench.drafters[label]), f"bench.drafters.{label}")
    return folders
