"""Where data/regen.py's answers come from: plain SGLang servers or the embedded transformers target.

Both backends take a batch of turns (`Gen`: prompt ids, a token budget, a seed, a priority) on one of their
`slots` and return one `Answer` per turn (generated ids, whether it stopped on a stop token); `open_backend` picks
one by ``harvest.backend``. The regeneration's workers call `generate(slot, batch)` from their own threads; a slot
belongs to one of the backend's `servers` (`slot_server`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from eagle3ft.config import HarvestConfig, TargetConfig
from eagle3ft.targets.base import Request, Sampling


class RegenError(RuntimeError):
    """A regeneration that cannot go on (a server failed for good, a bad answer)."""


@dataclass
class Gen:
    """One turn to generate."""

    prompt_ids: list[int]
    max_new_tokens: int
    seed: int
    priority: int = 0  # higher first: the user turns its conversation still has to answer, this one included


@dataclass
class Answer:
    ids: list[int]  # generated ids, the stop token included when generation stopped on one
    finished: bool  # stopped on a stop token (not cut by the budget)


class SGLangBackend:
    """Plain SGLang servers; `generate(slot, batch)` is one batched /generate call to the slot's server."""

    def __init__(self, client_cfg, sampling: Sampling, stop_ids: list[int]):
        from eagle3ft.targets.sglang import HTTPPolicy, server_info

        if not client_cfg.urls:
            raise RegenError("harvest.sglang.urls is empty")
        self.urls = [u.rstrip("/") for u in client_cfg.urls]
        self.policy = HTTPPolicy.of(client_cfg)
        for u in self.urls:  # a clear error before any work when a server is not there
            server_info(
                u,
                HTTPPolicy(
                    timeout_s=min(30.0, self.policy.timeout_s),
                    retries=self.policy.retries,
                    backoff_s=self.policy.backoff_s,
                ),
            )
        self.slots = [u for u in self.urls for _ in range(client_cfg.concurrency)]
        self.servers = len(self.urls)
        self.slot_server = [i for i in range(self.servers) for _ in range(client_cfg.concurrency)]
        self.batch, self.priority = client_cfg.prompts_per_request, client_cfg.priority
        self.sampling, self.stop_ids = sampling, [int(i) for i in stop_ids]
        self.trimmed = 0  # answers whose output_ids carried more ids than completion_tokens (see _answer)
        self._lock = threading.Lock()

    def describe(self) -> dict:
        return {
            "backend": "sglang",
            "servers": self.urls,
            "requests_in_flight_per_server": len(self.slots) // len(self.urls),
            "prompts_per_request": self.batch,
            "priority": self.priority,
        }

    def _params(self, g: Gen) -> dict:
        sp = {
            "max_new_tokens": int(g.max_new_tokens),
            "temperature": float(self.sampling.temperature),
            "top_p": float(self.sampling.top_p),
            "stop_token_ids": self.stop_ids,
        }
        if self.sampling.temperature > 0:
            sp["sampling_seed"] = int(g.seed)
        return sp

    def _answer(self, out: dict, g: Gen, where: str) -> Answer:
        ids = out.get("output_ids") if isinstance(out, dict) else None
        if ids is None:
            raise RegenError(f"{where}: an answer has no output_ids: {str(out)[:200]}")
        meta = out.get("meta_info") or {}
        ids = [int(t) for t in ids]
        n = meta.get("completion_tokens")
        if (
            isinstance(n, int) and len(ids) > n
        ):  # some releases put detokenizer context before the answer (sglang#17240)
            ids = ids[len(ids) - n :]
            with self._lock:
                self.trimmed += 1
        reason = meta.get("finish_reason") or {}
        kind = reason.get("type") if isinstance(reason, dict) else None
        if kind == "abort":
            raise RegenError(f"{where}: the server aborted a request: {reason}")
        matched = reason.get("matched") if isinstance(reason, dict) else None
        if kind == "stop" and isinstance(matched, int) and (not ids or ids[-1] != matched):
            ids.append(matched)  # a server that trims the stop token: the target generated it
        finished = bool(ids) and (ids[-1] in self.stop_ids or kind == "stop")
        return Answer(ids[: g.max_new_tokens], finished)

    def generate(self, slot: int, batch: list[Gen]) -> list[Answer]:
        from eagle3ft.targets.sglang import call

        url = self.slots[slot]
        payload = {"input_ids": [g.prompt_ids for g in batch], "sampling_params": [self._params(g) for g in batch]}
        if self.priority:  # one per request; a server without --enable-priority-scheduling ignores it
            payload["priority"] = max(g.priority for g in batch)
        body, _, _ = call(url, "/generate", payload, self.policy, what=f"/generate of {len(batch)} prompts")
        outs = body if isinstance(body, list) else [body]
        if len(outs) != len(batch):
            raise RegenError(f"{url}: {len(outs)} answers for {len(batch)} prompts")
        return [self._answer(o, g, url) for o, g in zip(outs, batch)]


class HFBackend:
    """The embedded transformers target: one worker, batches of harvest.batch_size."""

    def __init__(self, target: TargetConfig, harvest: HarvestConfig, sampling: Sampling, stop_ids: list[int]):
        from eagle3ft.targets.hf import HFTarget, load_target

        model, tokenizer = load_target(target)
        self.target = HFTarget(target, None, model=model, tokenizer=tokenizer)
        self.slots = ["embedded"]
        self.servers, self.slot_server = 1, [0]
        self.batch = harvest.batch_size
        self.sampling, self.stop_ids = sampling, tuple(stop_ids)
        self.trimmed = 0

    def describe(self) -> dict:
        return {"backend": "hf", "device": str(self.target.device), "batch_size": self.batch}

    def generate(self, slot: int, batch: list[Gen]) -> list[Answer]:
        reqs = [Request(g.prompt_ids, g.max_new_tokens, self.stop_ids, capture=False, seed=g.seed) for g in batch]
        results = self.target.process(reqs, self.sampling)
        return [
            Answer(r.completion_ids, bool(r.completion_ids) and r.completion_ids[-1] in self.stop_ids) for r in results
        ]


def open_backend(target: TargetConfig, harvest: HarvestConfig, sampling: Sampling, stop_ids: list[int]):
    if harvest.backend == "sglang":
        return SGLangBackend(harvest.sglang, sampling, stop_ids)
    if harvest.backend == "hf":
        return HFBackend(target, harvest, sampling, stop_ids)
    raise ValueError(f"harvest.backend {harvest.backend!r}: expected hf or sglang")
