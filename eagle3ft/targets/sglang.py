"""The SGLang target: harvest through running SGLang servers over HTTP.

It implements the ``Target`` protocol (base.py), so the harvest job treats it
like the embedded backend. One ``/generate`` call per sample where the server
allows it:

    {"input_ids": prompt, "sampling_params": {...},
     "return_hidden_states": true,                      # server: --enable-return-hidden-states
     "return_logprob": true, "logprob_start_len": 0, "top_logprobs_num": K}

and the answer's ``meta_info`` holds

- ``hidden_states``: a first block of one row per prompt token, then one row per
  generated token that was fed back (the last generated token never is). On a
  plain server the rows are the final-norm output (H); on an EAGLE3 server, or a
  server started with aux capture (SGLang >= 0.5.23), they are the aux layers
  concatenated (3H; K·H for a DFlash drafter's K layers, asked for in EAGLE-3's
  numbering: DFlashConfig.eagle3_capture_ids).
- ``input_top_logprobs``: per prompt token, K ``[logprob, id, null]`` for the
  distribution that predicted it (the first entry is null);
  ``output_top_logprobs``: the same for every generated token.
  Our rows are indexed by the position that predicts, so row t is entry t+1.

Capture strategies (``harvest.sglang.capture``):

- ``one_request``: generation and capture in one call. The server has no row
  for the final token (it is never fed back), so row T-1 of aux_hidden and
  top-k repeats row T-2 (row T-1 is never a training input).
- ``two_pass``: generate, then capture prompt+completion with one more token
  requested, so every row is the server's own. ``logprob_start_len: 0`` also
  keeps the radix cache from skipping the prefix. The default on speculative
  servers, whose per-token rows during verify were wrong in some releases
  (sgl-project/sglang#26163).
- ``auto``: two_pass on speculative servers, one_request otherwise.

``last_hidden`` is not offered: a server returns the last layer or the aux
layers, not both. Requests run concurrently (``concurrency`` per server),
sharded over every server URL, with timeouts and retries with backoff; a batch
either completes or raises ``SGLangError`` naming the request, server and cause.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from eagle3ft.config import TargetConfig
from eagle3ft.targets.base import Features, Request, Result, Sampling, TargetInfo
from eagle3ft.targets.sglang_http import (
    AUX_CAPTURE_MIN_VERSION,
    HTTPPolicy,
    ServerInfo,
    SGLangError,
    call,
    server_info,
    topk_arrays,
)
from eagle3ft.targets.sglang_versions import SUPPORTED, nearest

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- the target


def sampling_params(max_new_tokens: int, sampling: Sampling, stop_ids) -> dict:
    sp = {
        "max_new_tokens": int(max_new_tokens),
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
    }
    if stop_ids:
        sp["stop_token_ids"] = [int(i) for i in stop_ids]
    return sp


@dataclass
class CallStats:
    """Totals over the life of a target: requests, bytes, seconds spent receiving+decoding."""

    requests: int = 0
    retries: int = 0
    bytes: int = 0
    seconds: float = 0.0
    tokens: int = 0

    def add(self, st: dict, tokens: int) -> None:
        self.requests += 1
        self.retries += st["attempts"] - 1
        self.bytes += st["bytes"]
        self.seconds += st["seconds"]
        self.tokens += tokens


def target_architectures(target_cfg: TargetConfig) -> list[str] | None:
    """The served model's ``architectures`` (which decide how SGLang numbers captured layers): the tiny test target's,
    else the model folder's config.json; SGLangError when there is no folder to read."""
    if target_cfg.kind == "tiny":
        from eagle3ft.targets.hf import load_tokenizer, tiny_config

        return tiny_config(target_cfg, len(load_tokenizer(target_cfg))).architectures
    from eagle3ft.config import resolve_path

    cfg_file = resolve_path(target_cfg.path) / "config.json" if target_cfg.path else None
    if cfg_file is None or not cfg_file.is_file():
        raise SGLangError(
            f"the target's architectures are unknown here: set target.path to its folder (got {cfg_file})"
        )
    return json.loads(cfg_file.read_text()).get("architectures")


def target_identity(target_cfg, client_cfg) -> tuple[int, int, int]:
    """(hidden_size, vocab_size, num_layers) of the served model, without loading it.

    From ``harvest.sglang.hidden_size/vocab_size/num_layers`` when set (a node without
    the model folder), else the model folder's config.json (``text_config`` for
    multimodal wrappers such as Kimi-K2.5), else the tiny test target's config.
    """
    given = (client_cfg.hidden_size, client_cfg.vocab_size, client_cfg.num_layers)
    if all(v is not None for v in given):
        return given  # type: ignore[return-value]
    if target_cfg.kind == "tiny":
        from eagle3ft.targets.hf import load_tokenizer, tiny_config

        c = tiny_config(target_cfg, len(load_tokenizer(target_cfg)))
        return c.hidden_size, c.vocab_size, c.num_hidden_layers
    from eagle3ft.config import resolve_path

    path = resolve_path(target_cfg.path) if target_cfg.path else None
    cfg_file = path / "config.json" if path is not None else None
    if cfg_file is None or not cfg_file.is_file():
        raise SGLangError(
            "the target's identity is unknown here: set harvest.sglang.hidden_size, vocab_size and num_layers, or "
            f"target.path to a folder with config.json (got {path})"
        )
    raw = json.loads(cfg_file.read_text())
    raw = raw.get("text_config", raw)
    return int(raw["hidden_size"]), int(raw["vocab_size"]), int(raw["num_hidden_layers"])


class SGLangTarget:
    """Target protocol over one or more SGLang servers (one per node at scale).

    ``SGLangTarget(cfg.target, cfg.harvest.sglang, drafter_config)``: the identity comes
    from ``target_identity``, the aux layer ids from the drafter; every server is
    checked (version, hidden-state kind, layer ids) before anything is harvested.
    """

    def __init__(self, target_cfg, client_cfg, spec):
        hidden, vocab, layers = target_identity(target_cfg, client_cfg)
        ids = spec.check_target(hidden, vocab, layers)
        if not client_cfg.urls:
            raise SGLangError("harvest.sglang.urls is empty")
        if client_cfg.capture not in ("auto", "one_request", "two_pass"):
            raise SGLangError(
                f"harvest.sglang.capture must be auto, one_request or two_pass, not {client_cfg.capture!r}"
            )
        self.info = TargetInfo(target_cfg.name, hidden, vocab, layers, tuple(ids))
        self.urls = [u.rstrip("/") for u in client_cfg.urls]
        self.concurrency = max(1, int(client_cfg.concurrency))
        self.policy = HTTPPolicy.of(client_cfg)
        self.capture = client_cfg.capture
        self.stats = CallStats()
        self._lock = threading.Lock()
        self.servers = {u: self._check_server(u) for u in self.urls}

    def _check_server(self, url: str) -> ServerInfo:
        si = server_info(
            url,
            HTTPPolicy(
                timeout_s=min(30.0, self.policy.timeout_s), retries=self.policy.retries, backoff_s=self.policy.backoff_s
            ),
        )
        if nearest(si.version) is None:
            log.warning(
                "%s: SGLang %s is not a supported version (%s): its flags and meta_info keys are unchecked; "
                "`eagle3ft sglang-check --url %s` says what it returns",
                url, si.raw.get("version"), ", ".join(SUPPORTED), url,
            )  # fmt: skip
        if not si.raw.get("enable_return_hidden_states"):
            raise SGLangError(f"{url}: start the server with --enable-return-hidden-states")
        if not si.returns_aux:
            eagle3 = (
                "--speculative-algorithm EAGLE3 --speculative-draft-model-path <a drafter with those ids> "
                "(serve.harvest_capture: eagle3)"
            )
            way = (
                eagle3
                if si.version < AUX_CAPTURE_MIN_VERSION
                else f"{eagle3}, or aux capture without a draft (serve.harvest_capture: aux_flag)"
            )
            raise SGLangError(
                f"{url}: a plain server returns the last layer only; harvest needs the aux layers "
                f"{list(self.info.aux_layer_ids)}. "
                f"SGLang {'.'.join(map(str, si.version))} can: {way}"
            )
        ids = si.aux_capture_ids
        if ids is not None and list(ids) != list(self.info.aux_layer_ids):
            raise SGLangError(f"{url}: server captures layers {ids}, the drafter needs {list(self.info.aux_layer_ids)}")
        return si

    def _strategy(self, url: str) -> str:
        if self.capture != "auto":
            return self.capture
        return "two_pass" if self.servers[url].speculative else "one_request"

    # ------------------------------------------------------------------ one request

    def _generate(self, url: str, ids: list[int], max_new: int, sampling: Sampling, stop_ids, capture: bool, what: str):
        payload: dict[str, Any] = {"input_ids": ids, "sampling_params": sampling_params(max_new, sampling, stop_ids)}
        width = None
        if capture:
            width = len(self.info.aux_layer_ids) * self.info.hidden_size  # 3 for EAGLE-3, K for DFlash
            payload.update(
                return_hidden_states=True, return_logprob=True, logprob_start_len=0, top_logprobs_num=int(sampling.topk)
            )
        body, hidden, st = call(
            url, "/generate", payload, self.policy, width=width, what=what, rows_hint=len(ids) + max_new
        )
        out = body.get("output_ids") if isinstance(body, dict) else None
        if out is None:
            raise SGLangError(f"{what} at {url}: answer has no output_ids: {str(body)[:300]}")
        with self._lock:
            self.stats.add(st, len(ids) + len(out))
        return body, hidden, [int(t) for t in out]

    def _features(self, body: dict, hidden: np.ndarray | None, total: int, k: int, what: str) -> Features:
        """Rows for `total` tokens from a capture answer; a missing final row repeats the one before (see module
        doc)."""
        meta = body["meta_info"]
        if hidden is None:
            raise SGLangError(
                f"{what}: answer has no meta_info.hidden_states (server started without --enable-return-hidden-states?)"
            )
        rows = hidden.shape[0]
        if rows not in (total, total - 1):
            raise SGLangError(
                f"{what}: {rows} hidden-state rows for {total} tokens (expected {total - 1} or {total}); "
                "speculative servers of some versions drop rows during verify: use harvest.sglang.capture=two_pass"
            )
        inp = meta.get("input_top_logprobs") or []
        outp = meta.get("output_top_logprobs") or []
        entries = inp[1:] + outp
        if len(entries) < total - 1:
            raise SGLangError(f"{what}: {len(entries)} top-logprob rows for {total} tokens")
        ids, lps = topk_arrays(entries[:total], k)
        if ids.shape[0] == total - 1:
            ids, lps = np.concatenate([ids, ids[-1:]]), np.concatenate([lps, lps[-1:]])
        aux = torch.from_numpy(hidden[:total]).to(torch.bfloat16)
        if rows == total - 1:
            aux = torch.cat([aux, aux[-1:]])
        return Features(aux_hidden=aux, topk_ids=torch.from_numpy(ids), topk_logprobs=torch.from_numpy(lps))

    def _one(self, url: str, i: int, r: Request, sampling: Sampling) -> Result:
        what = f"request {i}"
        if not r.capture:
            _, _, out = self._generate(url, r.prompt_ids, r.max_new_tokens, sampling, r.stop_ids, False, what)
            return Result(completion_ids=out[: r.max_new_tokens], features=None)
        if r.max_new_tokens == 0 or self._strategy(url) == "two_pass":
            completion: list[int] = []
            if r.max_new_tokens > 0:
                _, _, completion = self._generate(
                    url, r.prompt_ids, r.max_new_tokens, sampling, r.stop_ids, False, what + " (generate)"
                )
            seq = list(r.prompt_ids) + completion
            greedy = Sampling(temperature=0.0, top_p=1.0, topk=sampling.topk, last_hidden=sampling.last_hidden)
            body, hidden, _ = self._generate(url, seq, 1, greedy, (), True, what + " (capture)")
            return Result(
                completion_ids=completion, features=self._features(body, hidden, len(seq), sampling.topk, what)
            )
        body, hidden, completion = self._generate(url, r.prompt_ids, r.max_new_tokens, sampling, r.stop_ids, True, what)
        total = len(r.prompt_ids) + len(completion)
        return Result(completion_ids=completion, features=self._features(body, hidden, total, sampling.topk, what))

    # ------------------------------------------------------------------ the protocol

    def process(self, requests_: list[Request], sampling: Sampling) -> list[Result]:
        """All requests concurrently: `concurrency` workers per server pull from one queue."""
        if sampling.last_hidden:
            raise SGLangError(
                "harvest.store_last_hidden with SGLang: a server returns either the last layer or the aux layers, not "
                "both"
            )
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(len(requests_)):
            todo.put(i)
        results: list[Result | None] = [None] * len(requests_)
        failures: list[str] = []
        stop = threading.Event()

        def worker(url: str) -> None:
            while not stop.is_set():
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    results[i] = self._one(url, i, requests_[i], sampling)
                except Exception as e:  # noqa: BLE001 - reported below with its request and server
                    failures.append(f"{url}: {e}")
                    stop.set()
                    return

        threads = [
            threading.Thread(target=worker, args=(u,), daemon=True) for u in self.urls for _ in range(self.concurrency)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise SGLangError(f"{len(failures)} request(s) failed; first: {failures[0]}")
        return results  # type: ignore[return-value]
