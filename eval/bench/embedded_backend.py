"""The `embedded` backend of the live benchmark: a transformers target and the drafter in this process
(eval/decode/speculate.py), batch 1, chain drafting (topk 1). Several drafters (eval.checkpoint and
bench.drafters) share the target; `use_drafter(label)` picks the one the next passes use.

The decoders of eval/decode/speculate.py time nothing; the timed subclasses here time around their phases,
the device synchronised on both sides of each: the prefill (through the first new token), every
target verify, every drafter forward (the extends and the draft steps), every whole cycle (draft +
verify + accept + extend), and the decode (after the first new token until the last). A graphed draft chain
(`bench.embedded.drafting`, eval/decode/draft_graph.py) is timed as one, and each of its forwards counts as its mean.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3ft.config import Config
from eagle3ft.data.chat import ChatFormat
from eagle3ft.data.store import check_run_drafter
from eagle3ft.drafter.dflash_model import DFlashDrafter
from eagle3ft.drafter.folder import DrafterFolder
from eagle3ft.eval.bench.backend import RequestResult, bench_drafters
from eagle3ft.eval.bench.environment import base_environment
from eagle3ft.eval.decode import chain_attention
from eagle3ft.eval.decode.dflash_decode import DFlashDecoder
from eagle3ft.eval.decode.speculate import Generation, PlainDecoder, SpeculativeDecoder, crop_target
from eagle3ft.eval.offline.same_prompts import offline_tau
from eagle3ft.run_dir import RunDir
from eagle3ft.setting import Setting
from eagle3ft.targets.hf import load_target


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timings:
    """One request's seconds."""

    prefill_s: float = 0.0  # the prompt's forward through the first new token, the drafter's extend included
    decode_s: float = 0.0  # after the first new token until the last
    verify_s: list[float] = field(default_factory=list)  # target forward per verify
    draft_forward_s: list[float] = field(default_factory=list)  # each drafter forward (extends and draft steps)
    cycle_s: list[float] = field(default_factory=list)  # draft + verify + accept + extend


class _Timed:
    """Times a decoder's prefill and decode into self.timings, one Timings per request."""

    device: torch.device
    timings: Timings

    def _time(self, into: list[float], fn, *args):
        sync(self.device)
        t = time.perf_counter()
        out = fn(*args)
        sync(self.device)
        into.append(time.perf_counter() - t)
        return out

    def prefill(self, *args):
        self.timings = Timings()
        sync(self.device)
        t0 = time.perf_counter()
        out = super().prefill(*args)
        sync(self.device)
        self._prefilled_at = time.perf_counter()
        self.timings.prefill_s = self._prefilled_at - t0
        return out

    def timed_generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[Generation, Timings]:
        g = self.generate(prompt_ids, max_new_tokens)
        sync(self.device)
        self.timings.decode_s = time.perf_counter() - self._prefilled_at
        return g, self.timings


class TimedPlainDecoder(_Timed, PlainDecoder):
    """PlainDecoder, timed: prefill and decode."""


class TimedSpeculativeDecoder(_Timed, SpeculativeDecoder):
    """SpeculativeDecoder, timed: prefill, decode, and per verify, drafter forward and cycle."""

    def extend(self, *args):
        return self._time(self.timings.draft_forward_s, super().extend, *args)

    def draft_step(self, *args):
        return self._time(self.timings.draft_forward_s, super().draft_step, *args)

    def draft_chain(self, *args):
        spent: list[float] = []
        drafts = self._time(spent, super().draft_chain, *args)
        if self.steps > 1:  # the chain's drafter forwards, each at their mean (its first draft needs none)
            self.timings.draft_forward_s += [spent[0] / (self.steps - 1)] * (self.steps - 1)
        return drafts

    def verify(self, *args):
        return self._time(self.timings.verify_s, super().verify, *args)

    def cycle(self, *args):
        return self._time(self.timings.cycle_s, super().cycle, *args)


class TimedDFlashDecoder(_Timed, DFlashDecoder):
    """DFlashDecoder, timed: prefill, decode, and per cycle its one drafter forward, its verify and the whole."""

    def draft(self, *args):
        return self._time(self.timings.draft_forward_s, super().draft, *args)

    def verify(self, *args):
        return self._time(self.timings.verify_s, super().verify, *args)

    def cycle(self, *args):
        return self._time(self.timings.cycle_s, super().cycle, *args)


def drafting_for(drafting: str, temperature: float) -> str:
    """bench.embedded.drafting -> the decoder's: auto is graph when greedy, eager when sampling."""
    if drafting not in ("auto", "graph", "eager"):
        raise ValueError(f"bench.embedded.drafting {drafting!r}: expected auto, graph or eager")
    if drafting == "graph" and temperature > 0:
        raise ValueError(
            f"bench.embedded.drafting graph drafts greedily: bench.temperature is {temperature}; use auto or eager"
        )
    return drafting if drafting != "auto" else ("graph" if temperature <= 0 else "eager")


class EmbeddedBackend:
    """transformers target + drafter in this process (eval/decode/speculate.py), batch 1."""

    name = "embedded"

    def __init__(self, cfg: Config, run_dir: Path, folders: dict[str, DrafterFolder] | None = None):
        """`folders`: bench_drafters' folders, already checked; None reads and checks them here (against the run's
        features when there are any), all before the target loads."""

        self.cfg = cfg
        if cfg.bench.embedded.threads:
            torch.set_num_threads(cfg.bench.embedded.threads)
        if folders is None:
            folders = {
                k: check_run_drafter(f, RunDir(run_dir).features)
                for k, f in bench_drafters(cfg.eval, cfg.bench, run_dir).items()
            }
        self.model, self.tokenizer = load_target(cfg.target)
        chain_attention.use(self.model, cfg.bench.embedded.attention)
        self.device = next(self.model.parameters()).device
        self.drafters, self.aux_ids = {}, {}
        for label, folder in folders.items():  # each in the target's dtype: a bf16 folder runs as the target does
            self.drafters[label], self.aux_ids[label] = folder.on_target(self.model)
        self.use_drafter(cfg.eval.checkpoint)
        self.eos_ids = ChatFormat(self.tokenizer, cfg.target.chat_template).stop_ids
        self.temperature = cfg.bench.temperature
        self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.drafting = drafting_for(cfg.bench.embedded.drafting, self.temperature)
        self._decoders: dict[tuple[str, int], TimedSpeculativeDecoder] = {}  # a graphed chain is captured once

    @property
    def drafter_labels(self) -> list[str]:
        return list(self.drafters)

    def use_drafter(self, label: str) -> None:
        """The drafter the next speculative passes (and offline_tau) use: eval.checkpoint's or a bench.drafters
        label."""
        self.drafter, self.aux_layer_ids = self.drafters[label], self.aux_ids[label]
        self.label = label

    def _result(self, i: int, g: Generation, t: Timings) -> RequestResult:
        spec = g.verify_count > 0
        return RequestResult(
            prompt_index=i,
            prompt_tokens=g.prompt_tokens,
            new_tokens=len(g.tokens),
            prefill_s=t.prefill_s,
            decode_s=t.decode_s,
            output_ids=g.tokens,
            verify_count=g.verify_count if spec else None,
            accept_lengths=g.accept_lengths if spec else None,
            verify_s=t.verify_s if spec else None,
            draft_forward_s=t.draft_forward_s if spec else None,
            cycle_s=t.cycle_s if spec else None,
            wall_s=t.prefill_s + t.decode_s,  # no transport in this process: the prefill and the decode
            finished=bool(g.tokens) and g.tokens[-1] in self.eos_ids,
        )

    def run_baseline(self, prompts, max_new_tokens, first_index=0):
        dec = TimedPlainDecoder(self.model, self.eos_ids, self.temperature, self.generator)
        return [self._result(i, *dec.timed_generate(p, max_new_tokens)) for i, p in enumerate(prompts, first_index)]

    def run_speculative(self, prompts, setting, max_new_tokens, first_index=0):
        if isinstance(self.drafter, DFlashDrafter):
            return self._run_dflash(prompts, setting, max_new_tokens, first_index)
        if setting.topk != 1 or setting.num_draft_tokens != setting.steps + 1:
            raise ValueError(
                f"embedded backend drafts chains only: setting {setting.key} needs topk 1 and num_draft_tokens = steps "
                "+ 1"
            )
        key = (self.label, setting.steps)
        if key not in self._decoders:
            self._decoders[key] = TimedSpeculativeDecoder(
                self.model, self.drafter, self.aux_layer_ids, setting.steps, self.temperature, self.eos_ids,
                self.generator, self.drafting, self.cfg.bench.embedded.draft_graph_extend,
            )  # fmt: skip
        dec = self._decoders[key]
        return [self._result(i, *dec.timed_generate(p, max_new_tokens)) for i, p in enumerate(prompts, first_index)]

    def _run_dflash(self, prompts, setting, max_new_tokens, first_index=0):
        """A DFlash drafter's block cycles (eval/decode/dflash_decode.py): the setting must be its block, B-1/1/B."""
        B = self.drafter.config.block_size
        if (setting.steps, setting.topk, setting.num_draft_tokens) != (B - 1, 1, B):
            raise ValueError(
                f"bench setting {setting.key} for the DFlash drafter {self.label}: a block cycle drafts B - 1 and "
                f"verifies B tokens; its setting is {B - 1}/1/{B}"
            )
        key = (self.label, setting.steps)
        if key not in self._decoders:
            self._decoders[key] = TimedDFlashDecoder(
                self.model, self.drafter, self.eos_ids, self.temperature, self.generator
            )
        dec = self._decoders[key]
        return [self._result(i, *dec.timed_generate(p, max_new_tokens)) for i, p in enumerate(prompts, first_index)]

    @torch.no_grad()
    def verify_costs(self, prompt: list[int], sizes: list[int], repeats: int = 5) -> dict[int, float]:
        """Median seconds of one target forward (with hidden states, as a verify) of n tokens after `prompt`."""
        from transformers import DynamicCache

        cache = DynamicCache()
        self.model(input_ids=torch.tensor([prompt], device=self.device), past_key_values=cache, use_cache=True)
        out = {}
        for n in sizes:
            ids = torch.tensor([prompt[-1:] * n], device=self.device)
            times = []
            for _ in range(repeats + 1):
                sync(self.device)
                t = time.perf_counter()
                self.model(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
                sync(self.device)
                times.append(time.perf_counter() - t)
                crop_target(cache, len(prompt))
            out[n] = statistics.median(times[1:])
        return out

    def offline_tau(self, prompts: list[list[int]], answers: list[list[int]], settings: list[Setting]) -> dict | None:
        """The drafter's offline tau on these prompts and the plain pass's answers (eval/offline/same_prompts.py)."""

        if isinstance(self.drafter, DFlashDrafter):  # same_prompts walks EAGLE-3 chains only
            return None
        return offline_tau(self.model, self.drafter, self.aux_layer_ids, prompts, answers, settings)

    def environment(self) -> dict:
        return {
            **base_environment(self.device),
            "backend": self.name,
            "target_dtype": str(next(self.model.parameters()).dtype),
            "attention": self.model.config._attn_implementation,
            "drafting": self.drafting,  # graph: a CUDA graph on a GPU, the same chain uncaptured elsewhere
            "draft_graph_extend": self.drafting == "graph" and self.cfg.bench.embedded.draft_graph_extend,
            "drafter_dtype": str(next(self.drafter.parameters()).dtype),
        }
