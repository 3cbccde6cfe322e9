"""A protocol double of an SGLang server, computed by the real embedded model.

SGLang cannot serve on CPU, so the client and the bench are tested against this:
a loopback HTTP server that answers the endpoints they call with the JSON shapes
SGLang returns, computed with a transformers model (and, for an EAGLE3 server,
the embedded speculative decoder of eval/decode/speculate.py; for a DFLASH server, the embedded block decoder of
eval/decode/dflash_decode.py with SGLang's target-only sampled verify). The shapes mirror
/work/shared/sglang-h200/README.md (measured on SGLang 0.5.17) and SGLang's
sources (http_server.py, tokenizer_manager.py, scheduler output processing). The model side is
tests/sglang_double_engine.py, each version's rules tests/sglang_double_rules.py; this file is the HTTP side
and the command line:

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
  (num_draft_tokens - 1)), spec_correct_drafts_histogram`` (verify steps by drafts accepted, as long as
  the most drafts accepted + 1); 0.5.17 adds the twins ``spec_accepted_drafts,
  spec_proposed_drafts, spec_accept_histogram`` (equal values in the real server's
  answers, benchmarks/results/sglang-vs-embedded-run1/sglres/bench/bench/sglang_requests.jsonl),
  which 0.5.23 removed (its srt/managers/tokenizer_manager.py:3164-3201 sends only the first six).
- ``max_new_tokens: 0`` (prefill only), on a plain or a speculative server: completion_tokens 0,
  no hidden-state entry, and one ``output_top_logprobs`` entry (the next-token distribution
  the prefill computed), as the real 0.5.17 server answered; ``output_token_logprobs`` is
  empty (its length was not recorded).
- ``GET /server_info`` and ``/get_server_info``: the server args (SGLang's names),
  scheduler info, ``internal_states[0].avg_spec_accept_length`` (lifetime; only once a
  speculative request has been verified, as SGLang's Scheduler.get_internal_state adds it
  only when cum_spec_accept_count > 0 and the real server had none before its first request)
  and ``version``; the sampled-verification settings each version has, at their defaults.
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

A DFLASH server (``--speculative-algorithm DFLASH``, a DFlash drafter folder): /server_info reports what 0.5.17's
launch hook resolves (tests/sglang_double_rules.py dflash_server_args: steps and topk 1, num_draft_tokens the block,
the draft attention backend, the accept thresholds); meta_info carries the same spec fields as EAGLE3's (the scheduler
counts both alike: managers/scheduler_components/batch_result_processor.py:683-690, proposed = verify_ct x (B - 1));
``return_logprob`` and ``return_hidden_states`` are refused with 400 as 0.5.17 aborts them (speculative/dflash_utils.py
validate_dflash_request, the overlap schedule on).

What it does not mirror is refused with a 400 naming it (streamed hidden states or logprobs,
tree drafting), never made up.
Faults for the retry tests are queued in-process: ``double.faults.append("500")``.

Launch flags are each version's own (read from its wheel): 0.5.17 takes ``--cuda-graph-max-bs`` as an alias and
has no aux capture; 0.5.23 refuses that alias as ambiguous, and takes ``--enable-return-aux-hidden-states`` only
beside ``--speculative-algorithm EAGLE3`` and without a draft model (then reports ``speculative_algorithm`` null),
as its srt/arg_groups/validation_hook.py:697-754 checks.

Run it alone with SGLang's launch flags (the launcher's tests do), serving an HF folder or a config's target; the
launcher passes the double's own two settings in the environment (SGLANG_DOUBLE_CONFIG, SGLANG_DOUBLE_VERSION: the
flags below), so its command line is one the real server's parser takes:
    python tests/sglang_double.py [--double-config configs/tiny.yaml] --model-path HF_DIR --port 30000 \
        --enable-return-hidden-states [--speculative-algorithm EAGLE3 --speculative-draft-model-path D ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

# the engine stands beside it; PYTHONSAFEPATH (benchmarks/leases/run_phases.sh's SERVER_CMD) leaves the script's
# folder off sys.path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_double_engine import BadRequest, DoubleEngine  # noqa: E402
from sglang_double_rules import (  # noqa: E402
    AUX_CAPTURE_FROM,
    REMOVED_IN_0_5_23,
    SAMPLING,
    VERSIONS,
    aux_capture,
    dflash_server_args,
    vt,
)

NO_TOKENIZER = (  # SGLang 0.5.17 srt/managers/tokenizer_manager.py, a text prompt on a --skip-tokenizer-init server
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please provide input_ids or "
    "re-initialize the engine with skip_tokenizer_init=False."
)


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
            "speculative_algorithm": engine.algorithm,
            "speculative_draft_model_path": None,
            "speculative_num_steps": engine.spec[0] if engine.speculative else None,
            "speculative_eagle_topk": engine.spec[1] if engine.speculative else None,
            "speculative_num_draft_tokens": engine.spec[2] if engine.speculative else None,
            "max_running_requests": 48 if engine.speculative else None,  # an EAGLE3 server's cap when unset
        }
        args.update(SAMPLING[version])
        if vt(version) >= AUX_CAPTURE_FROM:
            aux_only = engine.aux_layer_ids is not None and not engine.speculative
            args["enable_return_aux_hidden_states"] = aux_only
            args["return_aux_hidden_state_layer_ids"] = engine.aux_layer_ids if aux_only else None
            args["aux_hidden_state_capture"] = "eagle3" if aux_only else None
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
                for o in out if isinstance(out, list) else [out]:
                    if double.server_args.get("skip_tokenizer_init"):
                        o.pop("text", None)
                    if vt(double.version) >= AUX_CAPTURE_FROM:
                        for k in REMOVED_IN_0_5_23:
                            o["meta_info"].pop(k, None)
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
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--double-version", default=os.environ.get("SGLANG_DOUBLE_VERSION", "0.5.17"), choices=VERSIONS)
    version = pre.parse_known_args(argv)[0].double_version
    aux = vt(version) >= AUX_CAPTURE_FROM
    ap = argparse.ArgumentParser(description="SGLang protocol double")
    ap.add_argument(
        "--double-config",
        default=os.environ.get("SGLANG_DOUBLE_CONFIG"),
        help="eagle3ft config whose target the double serves (default: the HF folder --model-path)",
    )
    ap.add_argument("--double-version", default=version, choices=VERSIONS)
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
    ap.add_argument("--speculative-num-steps", type=int)
    ap.add_argument("--speculative-eagle-topk", type=int)
    ap.add_argument("--speculative-num-draft-tokens", type=int)
    ap.add_argument("--speculative-dflash-block-size", type=int)
    ap.add_argument("--speculative-draft-attention-backend")
    ap.add_argument("--speculative-accept-threshold-single", type=float, default=1.0)
    ap.add_argument("--speculative-accept-threshold-acc", type=float, default=1.0)
    if aux:
        ap.add_argument("--enable-return-aux-hidden-states", action="store_true")
        ap.add_argument("--return-aux-hidden-state-layer-ids", type=int, nargs="+")
    ap.add_argument("--skip-tokenizer-init", action="store_true")
    if not aux:  # 0.5.17's deprecated alias; 0.5.23's parser finds it ambiguous between the two below
        ap.add_argument("--cuda-graph-max-bs", type=int, dest="cuda_graph_max_bs_decode")
    ap.add_argument("--cuda-graph-max-bs-decode", type=int)
    ap.add_argument("--cuda-graph-max-bs-prefill", type=int)
    ap.add_argument("--cuda-graph-backend-prefill")  # 0.5.17: disabled leaves prefill graphs out
    ap.add_argument("--max-running-requests", type=int)
    ap.add_argument("--log-level")
    ap.add_argument("--sleep-on-idle", action="store_true")  # 0.5.17: an idle scheduler sleeps instead of polling
    args = ap.parse_args(argv)
    if args.host not in ("127.0.0.1", "localhost"):
        ap.error("the double serves on loopback only")
    aux_ids = aux_capture(ap, args) if aux else None

    from eagle3ft.config import Config, TargetConfig, load_config
    from eagle3ft.targets.hf import load_target

    cfg = (
        load_config(args.double_config)
        if args.double_config
        else Config(target=TargetConfig(kind="hf", path=args.model_path, device="cpu", dtype="float32"))
    )
    model, tok = load_target(cfg.target)
    drafter, spec_args = None, {}
    steps, topk, ndt = (
        args.speculative_num_steps or 3,
        args.speculative_eagle_topk or 1,
        args.speculative_num_draft_tokens,
    )
    if args.speculative_algorithm and aux_ids is None:
        if args.speculative_algorithm not in ("EAGLE3", "DFLASH") or not args.speculative_draft_model_path:
            ap.error("the double mirrors --speculative-algorithm EAGLE3 or DFLASH with --speculative-draft-model-path")
        if args.speculative_algorithm == "DFLASH":
            from eagle3ft.drafter import dflash_export

            dtype = next(model.parameters()).dtype  # the drafter runs in the served target's dtype
            drafter = dflash_export.load(args.speculative_draft_model_path, dtype).eval()
            try:
                spec_args = dflash_server_args(args, drafter.config.block_size)
            except ValueError as e:
                ap.error(str(e))
            steps, topk, ndt = 1, 1, spec_args["speculative_num_draft_tokens"]
        else:
            from eagle3ft.drafter.export import load_drafter
            from eagle3ft.targets.hf import load_input_embedding

            drafter = load_drafter(args.speculative_draft_model_path, load_input_embedding(cfg.target)).eval()
            if (args.speculative_accept_threshold_single, args.speculative_accept_threshold_acc) != (1.0, 1.0):
                ap.error("the double mirrors EAGLE3's sampled verify at accept thresholds 1 only")
    engine = DoubleEngine(model, tok, aux_ids, drafter, steps, topk, ndt or 4)
    if spec_args:
        engine.thresholds = (args.speculative_accept_threshold_single, args.speculative_accept_threshold_acc)
    names = {
        "model_path": args.model_path,
        "tokenizer_path": args.tokenizer_path or args.model_path,
        "tp_size": args.tp_size,
        "speculative_draft_model_path": args.speculative_draft_model_path,
        "enable_return_hidden_states": args.enable_return_hidden_states,
        "skip_tokenizer_init": args.skip_tokenizer_init,
    }
    if args.max_running_requests is not None:
        names["max_running_requests"] = args.max_running_requests
    names.update(spec_args)
    double = SGLangDouble(engine, args.double_version, names, port=args.port)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=double.httpd.shutdown, daemon=True).start())
    print(f"double serving {double.url} (SGLang {args.double_version})", flush=True)
    double.httpd.serve_forever(poll_interval=0.05)
    double.httpd.server_close()


if __name__ == "__main__":
    main()
