"""A protocol double of an SGLang server, computed by the real embedded model.

SGLang cannot serve on CPU, so the client and the bench are tested against this:
a loopback HTTP server that answers the endpoints they call with the JSON shapes
SGLang returns, computed with a transformers model (and, for an EAGLE3 server,
the embedded speculative decoder of eval/speculate.py). The shapes mirror
/work/shared/sglang-h200/README.md (measured on SGLang 0.5.17) and SGLang's
sources (http_server.py, tokenizer_manager.py, scheduler output processing):

- ``POST /generate`` -> ``{"text", "output_ids", "meta_info"}``; meta_info has
  ``id, finish_reason {type: length|stop, length|matched}, prompt_tokens,
  weight_version, num_retractions, completion_tokens, cached_tokens,
  cached_tokens_details, reasoning_tokens, dp_rank, response_sent_to_client_ts, e2e_latency``
  (the key set a real 0.5.17 server returned, tests/fixtures/sglang-0.5.17; the values of
  cached_tokens_details and dp_rank were not recorded, the double sends null);
  with ``return_logprob``: ``input_token_logprobs`` / ``output_token_logprobs``
  (``[logprob, id, null]``, the first prompt entry's logprob null), ``output_token_logprobs_length`` and, with
  ``top_logprobs_num`` K > 0, ``input_top_logprobs`` (the first entry null) /
  ``output_top_logprobs`` (K ``[logprob, id, null]``, sorted descending); with
  ``return_hidden_states``: ``hidden_states`` = one block of a row per prompt token,
  then one flat ``[W]`` row per generated token that was fed back (the layout the real
  server returned, tests/fixtures/sglang-0.5.17). Rows are
  the final-norm output on a plain server, the aux layers concatenated on an EAGLE3
  server (the draft's ``eagle_aux_hidden_state_layer_ids``) or on a server started
  with aux capture (``--enable-return-aux-hidden-states``, SGLang >= 0.5.23). Values
  are bf16, as the served model computes them. A finished request on a speculative
  server adds ``spec_verify_ct, spec_accept_length (= completion_tokens / verify_ct),
  spec_accept_rate, spec_num_correct_drafts, spec_num_proposed_drafts (= verify_ct *
  (num_draft_tokens - 1)), spec_accept_histogram`` (verify steps by drafts accepted, as long as
  the most drafts accepted + 1) and their 0.5.17 twins ``spec_accepted_drafts,
  spec_proposed_drafts, spec_correct_drafts_histogram`` (equal values in the real server's
  answers, benchmarks/results/sglang-vs-embedded-run1/sglres/bench/bench/sglang_requests.jsonl).
- ``max_new_tokens: 0`` (prefill only), on a plain or a speculative server: completion_tokens 0,
  no hidden-state entry, and one ``output_top_logprobs`` entry (the next-token distribution
  the prefill computed), as the real 0.5.17 server answered; ``output_token_logprobs`` is
  empty (its length was not recorded).
- ``GET /server_info`` and ``/get_server_info``: the server args (SGLang's names),
  scheduler info, ``internal_states[0].avg_spec_accept_length`` (lifetime; only once a
  speculative request has been verified, as SGLang's Scheduler.get_internal_state adds it
  only when cum_spec_accept_count > 0 and the real server had none before its first request)
  and ``version``. Where 0.5.23's answers are unrecorded, the 0.5.23 double answers as 0.5.17.
  ``GET /health``, ``/health_generate``, ``/get_model_info``; ``/flush_cache``.
- A batch (``input_ids`` a list of id lists, or ``text`` a list; ``sampling_params`` one dict or one
  per prompt, as SGLang's GenerateReqInput takes them) -> a JSON list of those answers, in order.
  A server started with ``--skip-tokenizer-init`` leaves out ``text`` and refuses a text prompt with a 400.
- Errors: ``{"object": "error", "message", "type", "param", "code"}`` with 400.

- ``"stream": true``: server-sent events ``data: {json}`` per decode step (per verify cycle on a
  speculative server), cumulative ``text``/``output_ids``/``completion_tokens``, ``finish_reason``
  null until the last event (which carries the ``spec_*`` fields), then ``data: [DONE]``. The
  events are paced by the embedded decoder's measured step times, so decode tok/s seen by a
  client is the embedded decoder's.

What it does not mirror is refused with a 400 naming it (streamed hidden states or logprobs,
tree drafting), never made up.
Faults for the retry tests are queued in-process: ``double.faults.append("500")``.

Run it alone with SGLang's launch flags (the launcher's tests do), serving an HF folder or a config's target:
    python tests/sglang_double.py [--double-config configs/tiny.yaml] --model-path HF_DIR --port 30000 \
        --enable-return-hidden-states [--speculative-algorithm EAGLE3 --speculative-draft-model-path D ...]
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
import uuid
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

VERSIONS = ("0.5.17", "0.5.23")
NO_TOKENIZER = (  # SGLang 0.5.17 srt/managers/tokenizer_manager.py, a text prompt on a --skip-tokenizer-init server
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please provide input_ids or "
    "re-initialize the engine with skip_tokenizer_init=False."
)
AUX_CAPTURE_FROM = (0, 5, 23)


def _vt(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in v.split("."))


def _bf16_rows(x: torch.Tensor) -> list:
    return x.to(torch.bfloat16).float().tolist()


def _top(logprobs: torch.Tensor, k: int) -> list:
    """(T, V) log-probabilities -> per position K [logprob, id, null], sorted descending."""
    v, i = logprobs.topk(k, dim=-1)
    return [[[lp, tid, None] for lp, tid in zip(vr, ir)] for vr, ir in zip(v.tolist(), i.tolist())]


class DoubleEngine:
    """The model side: generation, hidden states, logprobs, speculative counters."""

    def __init__(
        self,
        model,
        tokenizer,
        aux_layer_ids: list[int] | None = None,
        drafter=None,
        spec_steps: int = 3,
        spec_topk: int = 1,
        spec_num_draft_tokens: int = 4,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.drafter = drafter
        self.aux_layer_ids = (
            list(drafter.config.aux_layer_ids)
            if drafter is not None
            else (list(aux_layer_ids) if aux_layer_ids else None)
        )
        if drafter is not None:
            if spec_topk != 1 or spec_num_draft_tokens != spec_steps + 1:
                raise ValueError(
                    "the double mirrors chain drafting only (topk 1, num_draft_tokens = steps + 1), got "
                    f"{spec_steps}/{spec_topk}/{spec_num_draft_tokens}"
                )
            if self.aux_layer_ids is None:
                raise ValueError("the draft model's config names no eagle_aux_hidden_state_layer_ids")
        self.spec = (spec_steps, spec_topk, spec_num_draft_tokens)
        eos = tokenizer.eos_token_id
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.model_eos = {
            int(e)
            for e in ([eos] if eos is not None else [])
            + (list(gen_eos) if isinstance(gen_eos, (list, tuple)) else [gen_eos] if gen_eos is not None else [])
        }
        self.lock = threading.Lock()
        self.spec_tokens = 0
        self.spec_verifies = 0

    @property
    def speculative(self) -> bool:
        return self.drafter is not None

    def _generate(self, ids: list[int], sp: dict):
        from eagle3ft.eval.bench_embedded import TimedPlainDecoder, TimedSpeculativeDecoder

        max_new = int(sp.get("max_new_tokens", 128))
        temperature = float(sp.get("temperature", 1.0))
        stops = set(int(i) for i in sp.get("stop_token_ids") or []) | (
            set() if sp.get("ignore_eos") else self.model_eos
        )
        gen = torch.Generator().manual_seed(int(sp.get("sampling_seed", 0)))
        if max_new == 0:
            return [], None, None
        if self.drafter is None:
            g, timings = TimedPlainDecoder(self.model, stops, temperature, gen).timed_generate(ids, max_new)
            return g.tokens, None, timings
        steps = self.spec[0]
        dec = TimedSpeculativeDecoder(self.model, self.drafter, self.aux_layer_ids, steps, temperature, stops, gen)
        g, timings = dec.timed_generate(ids, max_new)
        return g.tokens, g, timings

    def generate_batch(self, req: dict) -> list[tuple[dict, list[tuple[float, int]]]]:
        """A batched /generate: one answer per prompt, in order; `sampling_params` one dict for all or one per
        prompt."""
        if req.get("stream"):
            raise BadRequest("the double does not mirror streamed batches")
        prompts = req.get("input_ids") if req.get("input_ids") is not None else req.get("text")
        sps = req.get("sampling_params")
        if isinstance(sps, list) and len(sps) != len(prompts):
            raise BadRequest(f"sampling_params has {len(sps)} entries for {len(prompts)} prompts")
        key = "input_ids" if req.get("input_ids") is not None else "text"
        per = [
            {**req, key: p, "sampling_params": sps[i] if isinstance(sps, list) else sps} for i, p in enumerate(prompts)
        ]
        if key == "input_ids":
            per = [{k: v for k, v in r.items() if k != "text"} for r in per]
        return [self.generate(r) for r in per]

    @torch.no_grad()
    def generate(self, req: dict) -> tuple[dict, list[tuple[float, int]]]:
        """(the answer, its stream timeline): chunks of (seconds after the previous chunk, new tokens),
        replaying the embedded decoder's measured decode (per verify cycle, or per token when plain)."""
        t0 = time.time()
        if req.get("stream") and (req.get("return_hidden_states") or req.get("return_logprob")):
            raise BadRequest("the double does not mirror streamed hidden states or logprobs")
        ids = req.get("input_ids")
        if ids is None:
            if req.get("text") is None:
                raise BadRequest("Either text or input_ids should be provided.")
            ids = self.tokenizer.encode(req["text"])
        if isinstance(ids[0], list):
            raise BadRequest("the double does not mirror batched /generate")
        ids = [int(i) for i in ids]
        sp = dict(req.get("sampling_params") or {})
        with self.lock:
            tokens, spec, timings = self._generate(ids, sp)
            fed = ids + tokens[:-1]  # the last generated token is never fed back
            out = self.model(input_ids=torch.tensor([fed]), output_hidden_states=True, use_cache=False)
            logits = out.logits[0].float()
            temperature = float(sp.get("temperature", 1.0))
            logprobs_in = torch.log_softmax(logits, dim=-1)
            logprobs_out = torch.log_softmax(logits / temperature, dim=-1) if temperature > 0 else logprobs_in
            if self.aux_layer_ids is not None:
                rows = torch.cat([out.hidden_states[i + 1][0] for i in self.aux_layer_ids], dim=-1)
            else:
                rows = out.hidden_states[-1][0]  # transformers' last entry is the final-norm output
            if spec is not None:
                self.spec_tokens += len(tokens)
                self.spec_verifies += spec.verify_count
        P, N = len(ids), len(tokens)
        finished_by_stop = (
            N > 0
            and (tokens[-1] in (set(int(i) for i in sp.get("stop_token_ids") or []) | self.model_eos))
            and not sp.get("ignore_eos")
        )
        meta: dict[str, Any] = {
            "id": req.get("rid") or uuid.uuid4().hex,
            "finish_reason": {"type": "stop", "matched": tokens[-1]}
            if finished_by_stop
            else {"type": "length", "length": N},
            "prompt_tokens": P,
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "dp_rank": None,
        }
        if req.get("return_logprob"):
            start = int(req.get("logprob_start_len", -1))
            start = P - 1 if start < 0 else start
            tok_in = [[None if t == 0 else logprobs_in[t - 1, ids[t]].item(), ids[t], None] for t in range(start, P)]
            tok_out = [[logprobs_out[P - 1 + j, tokens[j]].item(), tokens[j], None] for j in range(N)]
            meta["input_token_logprobs"] = tok_in
            meta["output_token_logprobs"] = tok_out
            meta["output_token_logprobs_length"] = len(tok_out)
            k = int(req.get("top_logprobs_num") or 0)
            if k > 0:
                top_in = _top(logprobs_in[max(start - 1, 0) : P - 1], k)
                meta["input_top_logprobs"] = ([None] if start == 0 else []) + top_in
                meta["output_top_logprobs"] = _top(logprobs_out[P - 1 : P - 1 + max(N, 1)], k)
        meta["completion_tokens"] = N
        meta["cached_tokens"] = 0
        meta["cached_tokens_details"] = None
        if req.get("return_hidden_states"):
            meta["hidden_states"] = ([_bf16_rows(rows[:P])] + _bf16_rows(rows[P:])) if N else []
        if spec is not None:
            steps, _, ndt = self.spec
            hist = [0] * max(spec.accept_lengths, default=1)
            for a in spec.accept_lengths:
                hist[a - 1] += 1
            correct = sum(a - 1 for a in spec.accept_lengths)
            proposed = spec.verify_count * (ndt - 1)
            meta.update(
                spec_verify_ct=spec.verify_count,
                spec_accept_length=N / spec.verify_count if spec.verify_count else 0,
                spec_accept_rate=correct / proposed if proposed else 0.0,
                spec_num_correct_drafts=correct,
                spec_num_proposed_drafts=proposed,
                spec_accept_histogram=hist,
                spec_accepted_drafts=correct,
                spec_proposed_drafts=proposed,
                spec_correct_drafts_histogram=list(hist),
            )
        meta["e2e_latency"] = time.time() - t0
        meta["response_sent_to_client_ts"] = time.time()
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        timeline: list[tuple[float, int]] = [(0.0, 1)] if N else []
        if spec is not None:
            left = N - 1
            for n, cycle in zip(spec.accept_lengths, timings.cycle_s):
                if left <= 0:
                    break
                timeline.append((cycle, min(n, left)))
                left -= n
        elif N > 1:
            timeline += [(timings.decode_s / (N - 1), 1)] * (N - 1)
        return {"text": text, "output_ids": tokens, "meta_info": meta}, timeline


class BadRequest(ValueError):
    pass


def _is_batch(req: dict) -> bool:
    """SGLang's GenerateReqInput: a list of id lists (or of texts) is a batch, answered with a list."""
    ids, text = req.get("input_ids"), req.get("text")
    return (isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)) or isinstance(text, list)


class SGLangDouble:
    """The HTTP side: a ThreadingHTTPServer on 127.0.0.1, ephemeral port unless given."""

    def __init__(
        self,
        engine: DoubleEngine,
        version: str = "0.5.17",
        server_args: dict | None = None,
        port: int = 0,
        server_info_paths=("/server_info", "/get_server_info"),
    ):
        if version not in VERSIONS:
            raise ValueError(f"double version {version!r}: one of {VERSIONS}")
        self.engine, self.version = engine, version
        self.server_info_paths = tuple(server_info_paths)
        self.faults: deque[str] = deque()  # consumed one per /generate: "500", "timeout", "close", "truncate"
        self.fault_sleep_s = 3.0
        self.requests = 0
        self.die_after: int | None = None  # behave as killed once this many /generate requests were answered
        self.dead = False  # kill(): every later request, on any connection, is dropped
        self.busy = 0  # /generate calls in flight
        self.busy_lock = threading.Lock()
        args = {
            "model_path": "double",
            "tokenizer_path": "double",
            "tp_size": 1,
            "dp_size": 1,
            "host": "127.0.0.1",
            "port": port,
            "enable_return_hidden_states": True,
            "speculative_algorithm": "EAGLE3" if engine.speculative else None,
            "speculative_draft_model_path": None,
            "speculative_num_steps": engine.spec[0] if engine.speculative else None,
            "speculative_eagle_topk": engine.spec[1] if engine.speculative else None,
            "speculative_num_draft_tokens": engine.spec[2] if engine.speculative else None,
        }
        if _vt(version) >= AUX_CAPTURE_FROM:
            aux_only = engine.aux_layer_ids is not None and not engine.speculative
            args["enable_return_aux_hidden_states"] = aux_only
            args["return_aux_hidden_state_layer_ids"] = engine.aux_layer_ids if aux_only else None
        elif engine.aux_layer_ids is not None and not engine.speculative:
            raise ValueError(
                f"aux capture without a draft model needs SGLang >= {AUX_CAPTURE_FROM}, the double plays {version}"
            )
        args.update(server_args or {})
        self.server_args = args
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.server_args["port"] = self.port
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None

    def server_info(self) -> dict:
        e = self.engine
        state = {"last_gen_throughput": 0.0}
        if e.speculative and e.spec_verifies:
            state["avg_spec_accept_length"] = e.spec_tokens / e.spec_verifies
        return {
            **self.server_args,
            "max_total_num_tokens": 1 << 16,
            "max_req_input_len": 1 << 15,
            "internal_states": [state],
            "version": self.version,
        }

    def _handler(self):
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code: int, body: bytes, ctype: str = "application/json", length: int | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                self.wfile.write(body)

            def _json(self, code: int, obj) -> None:
                self._send(code, json.dumps(obj, separators=(",", ":")).encode())

            def _error(self, code: int, message: str) -> None:
                self._json(
                    code,
                    {
                        "object": "error",
                        "message": message,
                        "type": "BadRequest" if code == 400 else "InternalServerError",
                        "param": None,
                        "code": code,
                    },
                )

            def do_GET(self):
                path = self.path.split("?")[0]
                if path in ("/health", "/health_generate"):
                    self._send(200, b"", "text/plain")
                elif path in double.server_info_paths:
                    self._json(200, double.server_info())
                elif path == "/get_model_info":
                    self._json(
                        200,
                        {
                            "model_path": double.server_args["model_path"],
                            "tokenizer_path": double.server_args["tokenizer_path"],
                            "is_generation": True,
                            "preferred_sampling_params": None,
                            "weight_version": "default",
                        },
                    )
                elif path == "/flush_cache":
                    self._send(200, b"Cache flushed.\n", "text/plain")
                else:
                    self._json(404, {"detail": "Not Found"})

            def do_POST(self):
                with double.busy_lock:
                    if double.die_after is not None and double.requests >= double.die_after:
                        double.dead = True  # dies on the request after die_after, wherever the client is
                if double.dead:  # a killed server: kept-alive connections drop too
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                path = self.path.split("?")[0]
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if path == "/flush_cache":
                    return self._send(200, b"Cache flushed.\n", "text/plain")
                if path != "/generate":
                    return self._json(404, {"detail": "Not Found"})
                with double.busy_lock:
                    double.requests += 1
                    double.busy += 1
                try:
                    self._generate(body)
                finally:
                    with double.busy_lock:
                        double.busy -= 1

            def _generate(self, body: bytes) -> None:
                fault = double.faults.popleft() if double.faults else None
                if fault == "500":
                    return self._error(500, "double: injected internal error")
                if fault == "timeout":
                    time.sleep(double.fault_sleep_s)
                if fault == "close":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                req = json.loads(body)
                if double.server_args.get("skip_tokenizer_init") and req.get("input_ids") is None:
                    return self._error(400, NO_TOKENIZER)
                try:
                    if _is_batch(req):
                        out, timeline = [o for o, _ in double.engine.generate_batch(req)], []
                    else:
                        out, timeline = double.engine.generate(req)
                except BadRequest as e:
                    return self._error(400, str(e))
                if double.server_args.get("skip_tokenizer_init"):
                    for o in out if isinstance(out, list) else [out]:
                        o.pop("text", None)
                if req.get("stream"):
                    return self._stream(out, timeline)
                data = json.dumps(out, separators=(",", ":")).encode()
                if fault == "truncate":
                    self.close_connection = True
                    return self._send(200, data[: len(data) // 2], length=len(data))
                self._send(200, data)

            def _stream(self, out: dict, timeline: list[tuple[float, int]]) -> None:
                """SSE as SGLang's /generate streams it: `data: {json}` per step, cumulative text and
                output_ids, finish_reason null until the last, then `data: [DONE]`."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")  # as uvicorn sends it: one HTTP chunk per event
                self.end_headers()

                def event(data: bytes) -> None:
                    data = b"data: " + data + b"\n\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()

                meta, ids = out["meta_info"], out["output_ids"]
                base = {
                    k: meta[k]
                    for k in ("id", "prompt_tokens", "weight_version", "num_retractions", "reasoning_tokens", "dp_rank")
                }
                n = 0
                for i, (delay, k) in enumerate(timeline):
                    time.sleep(delay)
                    n += k
                    if i < len(timeline) - 1:
                        chunk = {
                            "text": double.engine.tokenizer.decode(ids[:n], skip_special_tokens=True),
                            "output_ids": ids[:n],
                            "meta_info": {
                                **base,
                                "finish_reason": None,
                                "completion_tokens": n,
                                "cached_tokens": 0,
                                "cached_tokens_details": None,
                            },
                        }
                    else:
                        chunk = out
                    event(json.dumps(chunk, separators=(",", ":")).encode())
                if not timeline:
                    event(json.dumps(out, separators=(",", ":")).encode())
                event(b"[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

        return Handler

    def start(self) -> "SGLangDouble":
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        deadline = time.monotonic() + 30
        while self.busy and time.monotonic() < deadline:  # let in-flight answers finish before the model goes
            time.sleep(0.02)
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def kill(self) -> None:
        """As a killed server process: no new connections, and open keep-alive connections drop."""
        self.dead = True
        self.stop()

    def __enter__(self) -> "SGLangDouble":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """Serve the double in the foreground with SGLang's launch flags (those the launcher emits)."""
    ap = argparse.ArgumentParser(description="SGLang protocol double")
    ap.add_argument(
        "--double-config", help="eagle3ft config whose target the double serves (default: the HF folder --model-path)"
    )
    ap.add_argument("--double-version", default="0.5.17", choices=VERSIONS)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--tokenizer-path")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp-size", "--tp", type=int, default=1)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--mem-fraction-static", type=float)
    ap.add_argument("--attention-backend")
    ap.add_argument("--sampling-backend")
    ap.add_argument("--chat-template")
    ap.add_argument("--context-length", type=int)
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--enable-return-hidden-states", action="store_true")
    ap.add_argument("--speculative-algorithm")
    ap.add_argument("--speculative-draft-model-path")
    ap.add_argument("--speculative-num-steps", type=int, default=3)
    ap.add_argument("--speculative-eagle-topk", type=int, default=1)
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=4)
    ap.add_argument("--enable-return-aux-hidden-states", action="store_true")
    ap.add_argument("--return-aux-hidden-state-layer-ids", type=int, nargs="+")
    ap.add_argument("--skip-tokenizer-init", action="store_true")
    ap.add_argument("--cuda-graph-max-bs", type=int)
    ap.add_argument("--cuda-graph-backend-prefill")  # 0.5.17: disabled leaves prefill graphs out
    ap.add_argument("--max-running-requests", type=int)
    ap.add_argument("--log-level")
    ap.add_argument("--sleep-on-idle", action="store_true")  # 0.5.17: an idle scheduler sleeps instead of polling
    args = ap.parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost"):
        ap.error("the double serves on loopback only")
    if args.enable_return_aux_hidden_states and _vt(args.double_version) < AUX_CAPTURE_FROM:
        ap.error(f"unrecognized arguments: --enable-return-aux-hidden-states (SGLang {args.double_version})")

    from eagle3ft.config import Config, TargetConfig, load_config
    from eagle3ft.targets.hf import load_target

    cfg = (
        load_config(args.double_config)
        if args.double_config
        else Config(target=TargetConfig(kind="hf", path=args.model_path, device="cpu", dtype="float32"))
    )
    model, tok = load_target(cfg.target)
    drafter = None
    if args.speculative_algorithm:
        if args.speculative_algorithm != "EAGLE3" or not args.speculative_draft_model_path:
            ap.error("the double mirrors --speculative-algorithm EAGLE3 with --speculative-draft-model-path")
        from eagle3ft.drafter.export import load_drafter
        from eagle3ft.targets.hf import load_input_embedding

        drafter = load_drafter(args.speculative_draft_model_path, load_input_embedding(cfg.target)).eval()
    engine = DoubleEngine(
        model,
        tok,
        args.return_aux_hidden_state_layer_ids,
        drafter,
        args.speculative_num_steps,
        args.speculative_eagle_topk,
        args.speculative_num_draft_tokens,
    )
    names = {
        "model_path": args.model_path,
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "tp_size": args.tp_size,
        "speculative_draft_model_path": args.speculative_draft_model_path,
        "enable_return_hidden_states": args.enable_return_hidden_states,
        "skip_tokenizer_init": args.skip_tokenizer_init,
    }
    double = SGLangDouble(engine, args.double_version, names, port=args.port)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=double.httpd.shutdown, daemon=True).start())
    print(f"double serving {double.url} (SGLang {args.double_version})", flush=True)
    double.httpd.serve_forever(poll_interval=0.05)
    double.httpd.server_close()


if __name__ == "__main__":
    main()
