"""How fast, and in how much memory, a /generate answer with hidden states is decoded.

A body shaped like SGLang 0.5.17's (meta_info.hidden_states: a [P, W] block then [1, W]
rows, bf16 values printed as shortest floats, top-k logprobs) is decoded three ways:

- ``json``:    json.loads of the whole body, then the rows copied into a float32 array;
- ``stream-numpy``: eagle3ft/targets/sglang_http.py's HiddenStream fed 1 MiB chunks, numbers parsed by
  numpy's text parser (the fallback without pyarrow);
- ``stream``:  the same with pyarrow's CSV reader (the default; single-threaded per call, it lets
  go of the GIL, so concurrent requests parse on all cores);
- ``stream x4``: four bodies decoded by four threads at once (MB/s of all four).

    python benchmarks/sglang_decode.py [--tokens 512] [--widths 1728 21504]

prints one JSON line per (width, method): MB/s of body, tokens/s, peak heap (tracemalloc: Python
objects and numpy buffers, not pyarrow's own allocator).
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from eagle3ft.targets import sglang_http as client


def make_body(tokens: int, width: int, prompt: int, k: int = 32) -> tuple[bytes, np.ndarray]:
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(tokens, width, generator=g) * 2).to(torch.bfloat16).float().numpy()
    lp = [[[-0.1 * j, 1000 + j, None] for j in range(k)] for _ in range(prompt)]
    meta = {
        "id": "bench",
        "finish_reason": {"type": "length", "length": tokens - prompt + 1},
        "prompt_tokens": prompt,
        "input_top_logprobs": [None] + lp[1:],
        "output_top_logprobs": lp[: tokens - prompt + 1],
        "completion_tokens": tokens - prompt + 1,
        "hidden_states": [rows[:prompt].tolist()] + [[r] for r in rows[prompt:].tolist()],
        "e2e_latency": 1.0,
    }
    body = json.dumps(
        {"text": "x", "output_ids": list(range(tokens - prompt + 1)), "meta_info": meta}, separators=(",", ":")
    ).encode()
    return body, rows


def decode_json(body: bytes, width: int) -> np.ndarray:
    hs = json.loads(body)["meta_info"]["hidden_states"]
    out = np.empty((len(hs[0]) + len(hs) - 1, width), np.float32)
    out[: len(hs[0])] = hs[0]
    for i, r in enumerate(hs[1:]):
        out[len(hs[0]) + i] = r[0]
    return out


def decode_stream(body: bytes, width: int, chunk: int = 1 << 20) -> np.ndarray:
    s = client.HiddenStream(width, rows_hint=64)
    for a in range(0, len(body), chunk):
        s.feed(body[a : a + chunk])
    return s.finish()[1]


def decode_stream_numpy(body: bytes, width: int) -> np.ndarray:
    saved = client._parse_floats
    client._parse_floats = lambda seg: client._parse_floats_numpy(seg) if seg else np.empty(0, np.float32)
    try:
        return decode_stream(body, width)
    finally:
        client._parse_floats = saved


def decode_stream_x4(body: bytes, width: int) -> np.ndarray:
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: decode_stream(body, width), range(4)))
    return outs[0]


def measure(fn, body: bytes, width: int, rows: np.ndarray, repeats: int) -> dict:
    scale = 4 if fn is decode_stream_x4 else 1
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(body, width)
        best = min(best, time.perf_counter() - t0)
    assert np.array_equal(out, rows)
    tracemalloc.start()
    fn(body, width)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "seconds": round(best, 4),
        "MB_per_s": round(scale * len(body) / best / 1e6, 1),
        "tokens_per_s": round(scale * rows.shape[0] / best, 1),
        "peak_heap_MB": round(peak / 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--widths", type=int, nargs="+", default=[1728, 21504])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    methods = {
        "json": decode_json,
        "stream-numpy": decode_stream_numpy,
        "stream": decode_stream,
        "stream x4": decode_stream_x4,
    }
    for width in args.widths:
        body, rows = make_body(args.tokens, width, prompt=args.tokens // 2)
        for name, fn in methods.items():
            r = measure(fn, body, width, rows, args.repeats)
            print(
                json.dumps(
                    {
                        "width": width,
                        "tokens": args.tokens,
                        "body_MB": round(len(body) / 1e6, 2),
                        "bytes_per_token": round(len(body) / args.tokens),
                        "method": name,
                        **r,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
