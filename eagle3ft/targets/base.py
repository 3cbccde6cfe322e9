"""The one interface between the harvest job and a target model.

A target turns token-id requests into completions and, where asked, into the
features the drafter trains on. The embedded backend (hf.py) and the SGLang
client (sglang.py) both implement it; the harvest job never knows which one
it has. Chat formatting and the loss mask stay on the harvest side: a target
sees only token ids.

One request = one generation (possibly of zero tokens) plus, when
``capture`` is set, the features of the WHOLE sequence prompt + completion,
so a server regenerates the last assistant turn and captures it in one call.

Feature layout for a sequence of T = len(prompt_ids) + len(completion_ids) tokens:

- ``aux_hidden``   bf16  [T, 3*H]: row t = cat(output of decoder layer i at token t
                   for i in ``info.aux_layer_ids``) (SGLang's capture; transformers
                   ``hidden_states[i + 1]``).
- ``topk_ids``     int32 [T, K], ``topk_logprobs`` float32 [T, K]: the top-K of
                   log_softmax(logits at position t) at temperature 1, i.e. the
                   distribution over token t+1, sorted descending. (SGLang's
                   ``input_top_logprobs``/``output_top_logprobs`` are indexed by the
                   token they predict, so a client shifts them by one. Row T-1 is
                   never a training target; a server that cannot return it may
                   repeat row T-2.)
- ``last_hidden``  bf16  [T, H] or None: the final-norm output, only when asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class TargetInfo:
    """Identity of the target, recorded in the feature manifest and checked against the drafter."""

    name: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    aux_layer_ids: tuple[int, ...]


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn. temperature 0 = greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    topk: int = 32  # K of the captured distribution
    last_hidden: bool = False  # capture last_hidden too


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int  # 0 = no generation: capture the prompt as it is
    stop_ids: tuple[int, ...]  # generation ends after emitting one of these (it is kept)
    capture: bool  # return Features for prompt + completion
    seed: int = 0  # sampling seed (ignored when greedy)


@dataclass
class Features:
    aux_hidden: torch.Tensor  # bf16 [T, 3H]
    topk_ids: torch.Tensor  # int32 [T, K]
    topk_logprobs: torch.Tensor  # float32 [T, K]
    last_hidden: torch.Tensor | None = None  # bf16 [T, H]


@dataclass
class Result:
    completion_ids: list[int]  # generated tokens, the stop token included when one was emitted
    features: Features | None  # set iff the request asked for capture


@runtime_checkable
class Target(Protocol):
    info: TargetInfo

    def process(self, requests: list[Request], sampling: Sampling) -> list[Result]:
        """Serve a batch of requests; results in request order. Batching/concurrency is the target's business."""
        ...
