"""One batch-1 request to an SGLang server as the live bench times it: non-streamed (`whole_generate`, wall time) or
streamed (`stream_generate`, every event's arrival kept), and what its final meta_info says (the tokens per verify,
whether it finished)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import requests

from eagle3ft.targets.sglang_http import SGLangError
from eagle3ft.targets.sglang_versions import correct_drafts_histogram


def accept_lengths_from(meta: dict, new_tokens: int) -> list[int] | None:
    """Tokens emitted per verify (bonus included) from a finished request's spec fields."""
    verifies = int(meta.get("spec_verify_ct") or 0)
    if verifies <= 0:
        return None
    hist = correct_drafts_histogram(meta)
    if hist and sum(hist) == verifies:
        return [k + 1 for k, n in enumerate(hist) for _ in range(int(n))]
    per, extra = divmod(max(new_tokens - 1, verifies), verifies)
    return [per + (i < extra) for i in range(verifies)]


def _lines(resp: requests.Response):
    """Lines as their bytes arrive (chunk_size None: one read per HTTP chunk, as SGLang sends one per event)."""
    pending = b""
    for data in resp.iter_content(chunk_size=None):
        pending += data
        *lines, pending = pending.split(b"\n")
        yield from lines
    if pending:
        yield pending


@dataclass
class Streamed:
    """One streamed /generate as the client saw it."""

    meta: dict  # the last event's meta_info
    output_ids: list[int]
    prefill_s: float  # the request sent -> the first event with a token
    decode_s: float  # the first event with a token -> the last
    wall_s: float  # the request sent -> [DONE]
    events: list[list[float]]  # [seconds after the first token, tokens so far] per event with tokens


def stream_generate(url: str, ids: list[int], sp: dict, timeout_s: float) -> Streamed:
    """One streamed /generate, every event's arrival time kept."""
    t0 = time.perf_counter()
    first = last = None
    meta: dict = {}
    out: list[int] = []
    events: list[list[float]] = []
    try:
        resp = requests.post(
            url + "/generate",
            json={"input_ids": ids, "sampling_params": sp, "stream": True},
            stream=True,
            timeout=(10.0, timeout_s),
        )
    except requests.RequestException as e:
        raise SGLangError(f"{url}/generate: {e}") from None
    with resp:
        if resp.status_code != 200:
            raise SGLangError(f"{url}/generate: HTTP {resp.status_code}: {resp.text[:300]}")
        done = False
        for line in _lines(resp):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            ev = json.loads(data)
            if "error" in ev:
                raise SGLangError(f"{url}/generate: {ev['error']}")
            now = time.perf_counter()
            meta = ev["meta_info"]
            got = ev.get("output_ids") or []
            n = int(meta.get("completion_tokens", len(got)))
            out = (
                list(got) if len(got) == n else out + list(got)
            )  # cumulative (default) or incremental (--stream-output)
            if n > 0:
                first = now if first is None else first
                last = now
                if not events or n > events[-1][1]:
                    events.append([now - first, n])
        if not done:
            raise SGLangError(f"{url}/generate: the stream ended without [DONE]")
    wall = time.perf_counter() - t0
    if first is None:
        return Streamed(meta, out, wall, 0.0, wall, events)
    return Streamed(meta, out, first - t0, last - first, wall, events)


def whole_generate(url: str, ids: list[int], sp: dict, timeout_s: float) -> tuple[dict, list[int], float]:
    """One non-streamed /generate, as a user's client sends it: (meta_info, output ids, seconds from sending the
    request to holding the whole answer)."""
    t0 = time.perf_counter()
    try:
        resp = requests.post(
            url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=(10.0, timeout_s)
        )
        body = resp.json() if resp.status_code == 200 else None
    except (requests.RequestException, ValueError) as e:
        raise SGLangError(f"{url}/generate: {e}") from None
    wall = time.perf_counter() - t0
    if body is None:
        raise SGLangError(f"{url}/generate: HTTP {resp.status_code}: {resp.text[:300]}")
    return body["meta_info"], list(body.get("output_ids") or []), wall


def finished(meta: dict) -> bool:
    """SGLang's finish_reason: stopped on a stop id or token ("stop"), not at max_new_tokens ("length")."""
    return (meta.get("finish_reason") or {}).get("type") == "stop"
