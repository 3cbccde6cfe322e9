"""Talking to an SGLang server: its identity (GET /server_info), the /generate body decoded as it streams, and
HTTP with timeouts and retries. The SGLang target (sglang.py), the regeneration (data/regen.py) and the live bench
(eval/bench/sglang_backend.py) all go through `call`.

Hidden states arrive as JSON floats (~16 KB/token at 3x576, ~200 KB/token at
3x7168). The body is streamed: ``HiddenStream`` parses the hidden-state numbers
chunk by chunk (pyarrow's CSV parser, the GIL released; numpy without pyarrow)
into one float32 array sized for prompt + max_new_tokens rows, while the rest of
the body is parsed with ``json`` afterwards, so neither the whole body nor a
Python list of floats is ever held (benchmarks/sglang_decode.py measures it).
"""

from __future__ import annotations

import io
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import requests

log = logging.getLogger(__name__)

AUX_CAPTURE_MIN_VERSION = (0, 5, 23)  # --enable-return-aux-hidden-states


class SGLangError(RuntimeError):
    """A request that failed for good (after retries), or a server that does not fit."""


class RetryableError(SGLangError):
    """A failure worth another attempt: timeout, refused connection, 5xx, truncated body."""


# --------------------------------------------------------------------------- server identity


def parse_version(text: str) -> tuple[int, ...]:
    """'0.5.17' -> (0, 5, 17); '0.5.23rc1' or '0.5.23.post2' -> (0, 5, 23)."""
    parts = []
    for p in str(text).split(".")[:3]:
        m = re.match(r"\d+", p)
        if not m:
            break
        parts.append(int(m.group()))
    if not parts:
        raise SGLangError(f"cannot parse an SGLang version from {text!r}")
    return tuple(parts)


@dataclass
class ServerInfo:
    """What a running server says about itself (GET /server_info, or /get_server_info before it existed)."""

    url: str
    version: tuple[int, ...]
    raw: dict = field(repr=False)

    @property
    def speculative(self) -> bool:
        return bool(self.raw.get("speculative_algorithm"))

    @property
    def aux_capture_ids(self) -> list[int] | None:
        """Layer ids of a server started with aux capture and no draft model (SGLang >= 0.5.23)."""
        if not self.raw.get("enable_return_aux_hidden_states"):
            return None
        ids = self.raw.get("return_aux_hidden_state_layer_ids")
        return [int(i) for i in ids] if ids is not None else None

    @property
    def returns_aux(self) -> bool:
        """True when meta_info.hidden_states rows are the 3 aux layers, False when they are the last layer."""
        return self.raw.get("speculative_algorithm") in ("EAGLE3",) or bool(
            self.raw.get("enable_return_aux_hidden_states")
        )

    @property
    def avg_spec_accept_length(self) -> float | None:
        states = self.raw.get("internal_states") or [{}]
        v = states[0].get("avg_spec_accept_length")
        return float(v) if v is not None else None


# --------------------------------------------------------------------------- streaming decode


_KEY = b'"hidden_states":'
_DELETE = b"[] \n\r\t"


def _parse_floats_numpy(seg: bytes) -> np.ndarray:
    try:
        out = np.fromstring(seg, dtype=np.float32, sep=",")
    except ValueError:
        out = None
    if out is None or out.size != seg.count(b",") + 1:
        raise SGLangError(f"hidden_states hold a value that is not a number near {seg[:80]!r}")
    return out


def _parse_floats_arrow(seg: bytes) -> np.ndarray:
    """pyarrow's CSV reader parses on every core and lets go of the GIL (2-3x numpy's text parser here)."""
    try:
        table = _pacsv.read_csv(
            io.BytesIO(seg.replace(b",", b"\n")),
            read_options=_pacsv.ReadOptions(column_names=["x"], block_size=1 << 22, use_threads=False),
            convert_options=_pacsv.ConvertOptions(column_types={"x": _pa.float32()}, strings_can_be_null=False),
        )
    except _pa.ArrowInvalid:
        table = None
    if table is None or table.column(0).null_count or table.num_rows != seg.count(b",") + 1:
        raise SGLangError(f"hidden_states hold a value that is not a number near {seg[:80]!r}")
    return table.column(0).to_numpy()


try:
    import pyarrow as _pa
    import pyarrow.csv as _pacsv
except ImportError:  # pragma: no cover - pyarrow comes with datasets
    _pa = None

ARROW_MIN_BYTES = 1 << 16


def _parse_floats(seg: bytes) -> np.ndarray:
    """Comma-separated decimal numbers (no brackets) -> float32; raises on anything else (null, NaN)."""
    if not seg:
        return np.empty(0, np.float32)
    if _pa is not None and len(seg) >= ARROW_MIN_BYTES:
        return _parse_floats_arrow(seg)
    return _parse_floats_numpy(seg)


class HiddenStream:
    """Incremental decoder for one /generate body.

    ``feed(chunk)`` as bytes arrive, ``finish()`` at the end: returns the body as a
    dict whose ``meta_info.hidden_states`` is None, plus the hidden-state rows as
    float32 [rows, width] (None when the body had none). The hidden-state value
    of SGLang's answer is nested lists of numbers only; it ends at the first
    ``]`` followed by ``,"`` or ``}``, which cannot occur inside it.
    """

    def __init__(self, width: int, rows_hint: int = 64):
        self.width = width
        self._pre = bytearray()
        self._post = bytearray()
        self._carry = b""
        self._state = 0  # 0 before the key, 1 inside the value, 2 after it
        self._buf = np.empty(max(rows_hint, 1) * width, np.float32)
        self._n = 0
        self.bytes = 0

    def _append(self, vals: np.ndarray) -> None:
        need = self._n + vals.size
        if need > self._buf.size:
            grown = np.empty(max(need, 2 * self._buf.size), np.float32)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : need] = vals
        self._n = need

    def feed(self, chunk: bytes) -> None:
        self.bytes += len(chunk)
        if self._state == 0:
            start = max(0, len(self._pre) - len(_KEY))
            self._pre += chunk
            k = self._pre.find(_KEY, start)
            if k < 0:
                return
            rest = bytes(self._pre[k + len(_KEY) :])
            del self._pre[k + len(_KEY) :]
            self._state = 1
            self._feed_value(rest)
        elif self._state == 1:
            self._feed_value(chunk)
        else:
            self._post += chunk

    def _feed_value(self, chunk: bytes) -> None:
        data = self._carry + chunk
        ends = [e for e in (data.find(b'],"'), data.find(b"]}")) if e >= 0]
        if ends:
            end = min(ends) + 1
            self._append(_parse_floats(data[:end].translate(None, _DELETE)))
            self._carry = b""
            self._state = 2
            self._post += data[end:]
            return
        cut = data.rfind(b",", 0, len(data) - 1)  # a final comma may open the '],"' that ends the value
        if cut < 0:
            self._carry = data
            return
        self._append(_parse_floats(data[:cut].translate(None, _DELETE)))
        self._carry = data[cut + 1 :]

    def finish(self) -> tuple[dict, np.ndarray | None]:
        if self._state == 1:
            raise RetryableError("body ended inside meta_info.hidden_states (truncated)")
        try:
            if self._state == 0:
                return json.loads(bytes(self._pre)), None
            body = json.loads(bytes(self._pre) + b"null" + bytes(self._post))
        except json.JSONDecodeError as e:
            raise RetryableError(f"body is not complete JSON ({e})") from None
        if self._n % self.width:
            raise SGLangError(f"hidden_states hold {self._n} numbers, not a multiple of the row width {self.width}")
        return body, self._buf[: self._n].reshape(-1, self.width)


def topk_arrays(entries: list, k: int) -> tuple[np.ndarray, np.ndarray]:
    """SGLang top-logprob entries (each K [logprob, id, text|null]) -> ids int32 [n, K], logprobs float32 [n, K],
    sorted descending."""
    n = len(entries)
    ids = np.empty((n, k), np.int32)
    lps = np.empty((n, k), np.float32)
    for i, e in enumerate(entries):
        if e is None or len(e) < k:
            raise SGLangError(f"top-logprob entry {i} has {0 if e is None else len(e)} candidates, expected {k}")
        lps[i] = [c[0] for c in e[:k]]
        ids[i] = [c[1] for c in e[:k]]
    order = np.argsort(-lps, axis=1, kind="stable")
    if not (order == np.arange(k)).all():
        lps = np.take_along_axis(lps, order, 1)
        ids = np.take_along_axis(ids, order, 1)
    return ids, lps


# --------------------------------------------------------------------------- HTTP


_local = threading.local()


def _session() -> requests.Session:
    s = getattr(_local, "session", None)
    if s is None:
        s = _local.session = requests.Session()
    return s


@dataclass
class HTTPPolicy:
    timeout_s: float = 600.0  # whole request, body included
    connect_timeout_s: float = 10.0
    retries: int = 3  # further attempts after the first
    backoff_s: float = 1.0  # before retry i: backoff_s * 2**i
    chunk_bytes: int = 1 << 20

    @classmethod
    def of(cls, client_cfg) -> "HTTPPolicy":
        t = float(client_cfg.timeout_s)
        return cls(
            timeout_s=t, connect_timeout_s=min(10.0, t), retries=client_cfg.retries, backoff_s=client_cfg.backoff_s
        )


def _attempt(url: str, path: str, payload: dict | None, policy: HTTPPolicy, width: int | None, rows_hint: int):
    t0 = time.monotonic()
    try:
        if payload is None:
            resp = _session().get(url + path, timeout=(policy.connect_timeout_s, policy.timeout_s), stream=True)
        else:
            resp = _session().post(
                url + path, json=payload, timeout=(policy.connect_timeout_s, policy.timeout_s), stream=True
            )
    except requests.Timeout as e:
        raise RetryableError(f"timed out after {policy.timeout_s:.0f} s ({type(e).__name__})") from None
    except requests.ConnectionError as e:
        raise RetryableError(f"connection failed: {e}") from None
    with resp:
        if resp.status_code >= 500 or resp.status_code == 429:
            raise RetryableError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code >= 400:
            raise SGLangError(f"HTTP {resp.status_code} from {url}{path}: {resp.text[:500]}")
        stream = HiddenStream(width or 1, rows_hint if width else 1)
        try:
            for chunk in resp.iter_content(chunk_size=policy.chunk_bytes):
                stream.feed(chunk)
                if time.monotonic() - t0 > policy.timeout_s:
                    raise RetryableError(f"body still arriving after {policy.timeout_s:.0f} s")
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError, requests.Timeout) as e:
            raise RetryableError(f"body broken off after {stream.bytes} bytes: {type(e).__name__}") from None
        body, hidden = stream.finish()
    return body, hidden, stream.bytes, time.monotonic() - t0


def call(
    url: str,
    path: str,
    payload: dict | None,
    policy: HTTPPolicy,
    width: int | None = None,
    what: str = "",
    rows_hint: int = 64,
) -> tuple[Any, np.ndarray | None, dict]:
    """One HTTP exchange with retries. Returns (json body, hidden rows or None, stats).

    `width`: the hidden-state row width when the answer carries hidden states; `rows_hint`: the
    rows expected, so the array is allocated once.
    Bounded: at most 1 + policy.retries attempts, each limited by policy.timeout_s.
    """
    last = None
    for attempt in range(policy.retries + 1):
        if attempt:
            time.sleep(policy.backoff_s * 2 ** (attempt - 1))
        try:
            body, hidden, nbytes, secs = _attempt(url, path, payload, policy, width, rows_hint)
            return body, hidden, {"bytes": nbytes, "seconds": secs, "attempts": attempt + 1}
        except RetryableError as e:
            last = e
            log.warning("%s %s%s attempt %d/%d: %s", what, url, path, attempt + 1, policy.retries + 1, e)
    raise SGLangError(f"{what or path} failed at {url} after {policy.retries + 1} attempts: {last}")


def get_json(url: str, path: str, policy: HTTPPolicy) -> Any:
    return call(url, path, None, policy, what=f"GET {path}")[0]


def server_info(url: str, policy: HTTPPolicy | None = None) -> ServerInfo:
    """GET /server_info (SGLang 0.5.x), falling back to /get_server_info on servers that predate it."""
    policy = policy or HTTPPolicy(timeout_s=30.0, retries=1, backoff_s=0.5)
    url = url.rstrip("/")
    try:
        raw = get_json(url, "/server_info", policy)
    except SGLangError as e:
        if "HTTP 404" not in str(e):
            raise
        raw = get_json(url, "/get_server_info", policy)
    if "version" not in raw:
        raise SGLangError(f"{url}: server info has no 'version' (keys: {sorted(raw)[:12]}...)")
    return ServerInfo(url=url, version=parse_version(raw["version"]), raw=raw)
