"""The `sglang` backend of the live benchmark (eval/bench/schedule.py): live SGLang servers, baseline against EAGLE3 or
DFLASH (a DFlash drafter in eval.checkpoint: its one setting B-1/1/B, served with --speculative-algorithm DFLASH).

Servers come from the config: ``bench.sglang.baseline_url`` / ``bench.sglang.speculative_url`` and
``bench.sglang.speculative_urls`` (already running; each speculative one serves the one setting it was started with,
read from its ``/server_info`` once, and each setting runs on the one that serves it), or ``bench.sglang.launch: true``
(the baseline and one EAGLE3 server per setting, started from ``serve`` with the exported drafter
``eval.checkpoint``; at most
``serve.max_servers`` at once, the least recently used stopped first; all stopped by ``close()``
or at exit).

Per prompt and arm (batch 1, as eval/bench/schedule.py runs them), ``bench.sglang.requests`` in order: ``whole``, a
non-streamed ``POST /generate`` timed from sending it to holding the answer (the e2e figure a user's client sees,
prefill and transport included), and ``stream``, the same with ``"stream": true``: the first event with a token ends
the prefill; decode_s runs from it to the last event, so tok/s = (new_tokens - 1) / decode_s as for the embedded
backend, and each event's arrival is kept (SGLang 0.5.17 sends one per verify at batch 1: the spans
eval/bench/live_splits.py splits loops off by). With ``whole`` alone, its wall time stands for the decode too. The last event's
``spec_verify_ct`` and ``spec_correct_drafts_histogram`` (verify steps by drafts accepted; 0.5.17's old twin
``spec_accept_histogram`` where only it came) give the
verify count and the tokens per verify (bonus included); without a histogram the tokens after
the first are spread over the verifies. Every request's ``meta_info`` spec fields go to
RUN/bench/sglang_requests.jsonl, and after each speculative pass the server's own
``internal_states[0].avg_spec_accept_length`` is recorded: both taus land in the environment.
The cache is flushed before each pass (``bench.sglang.flush_cache: pass``; with ``bench.interleave: prompt`` a pass is one
prompt), or never.

Throughput at concurrency (``bench.concurrency`` levels above 1): ``run_concurrency`` sends
the prompts with that many requests in flight, baseline and each setting interleaved per
repetition, and writes RUN/bench/concurrency.json (output tok/s = all new tokens / wall time).

    eagle3ft bench --config CFG --run-dir RUN --set bench.backend=sglang --set "bench.concurrency=[1,8]"
    (python eval/bench/sglang_backend.py ARGS is that command with bench.backend sglang)
"""

from __future__ import annotations

import atexit
import os
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import requests

from eagle3ft.config import BenchConfig, Config
from eagle3ft.data.chat import ChatFormat
from eagle3ft.data.store import check_run_drafter
from eagle3ft.drafter.folder import DrafterFolder
from eagle3ft.eval.bench.backend import RequestResult
from eagle3ft.eval.bench.environment import base_environment, gpu_clocks
from eagle3ft.eval.bench.live_splits import spread
from eagle3ft.eval.bench.sglang_requests import accept_lengths_from, finished, stream_generate, whole_generate
from eagle3ft.files import json_text, write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.setting import Setting
from eagle3ft.targets.sglang_http import HTTPPolicy, SGLangError, call, server_info
from eagle3ft.targets.sglang_server import SGLangServer, server_for
from eagle3ft.targets.sglang_versions import SAMPLING_KEYS, sampling_settings

ENV_PREFIXES = ("NCCL_", "SGLANG_", "CUDA_", "TORCH_", "NVIDIA_", "PYTORCH_")
SERVER_ARGS_KEPT = (
    "model_path", "tp_size", "dp_size", "ep_size", "dtype", "quantization", "kv_cache_dtype", "context_length",
    "mem_fraction_static", "max_running_requests", "chunked_prefill_size", "attention_backend", "sampling_backend",
    "disable_cuda_graph", "cuda_graph_max_bs", "cuda_graph_max_bs_decode", "disable_radix_cache",
    "enable_return_hidden_states",
    "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
    "speculative_num_draft_tokens", "trust_remote_code", "chat_template", "cuda_graph_backend_prefill", "sleep_on_idle",
    "disable_overlap_schedule", *SAMPLING_KEYS,
)  # fmt: skip


DFLASH_GREEDY_FALLBACK = "DFLASH non-greedy verification is unavailable on this build/device"


def read_log(path: Path) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


class SGLangBackend:
    name = "sglang"

    def __init__(self, cfg: Config, run_dir: Path):
        from eagle3ft.targets.hf import load_tokenizer  # transformers: off this module's --help path

        self.cfg, self.run_dir = cfg, Path(run_dir)
        arms = 1 + len(cfg.bench.settings)
        if cfg.bench.sglang.launch and 0 < cfg.serve.max_servers < arms and cfg.bench.interleave == "prompt":
            raise ValueError(
                f"bench.interleave prompt with serve.max_servers {cfg.serve.max_servers} and {arms} arms would restart a "
                "server for every prompt: set bench.interleave: pass (a server per pass), or serve.max_servers 0"
            )
        # the EAGLE3 servers load eval.checkpoint, same_prompts drafts with it: it must fit the features, before any
        # server starts
        self.drafter = None
        if cfg.bench.sglang.launch or cfg.bench.sglang.same_prompts:
            folder = DrafterFolder.of_run(self.run_dir, cfg.eval.checkpoint)
            self.drafter = check_run_drafter(folder, RunDir(self.run_dir).features)
            if cfg.bench.sglang.same_prompts and self.drafter.family == "dflash":
                raise ValueError(
                    "bench.sglang.same_prompts walks EAGLE-3 chains; for the DFlash drafter "
                    f"{folder.path} set it false (its offline tau: eagle3ft eval)"
                )
        if not cfg.bench.sglang.requests:
            raise ValueError("bench.sglang.requests is empty: name whole, stream or both")
        self.tokenizer = load_tokenizer(cfg.target)  # the served target's: the caller renders the prompts with it
        self.eos_ids = list(ChatFormat(self.tokenizer, cfg.target.chat_template).stop_ids)
        self.timeout_s = float(cfg.bench.sglang.timeout_s)
        self.launched: dict[str, SGLangServer] = {}  # key -> server, least recently used first
        self.server_logs: dict[str, Path] = {}  # key -> the log of every server launched for it
        self._ports: dict[str, int] = {}
        self.infos: dict[str, dict] = {}
        self._given: dict[str, tuple[str, dict, str]] | None = None  # _given_speculative, once
        self.server_tau: dict[str, list[float]] = {}
        self.request_tau: dict[str, list[float]] = {}
        bench = RunDir(self.run_dir).bench
        bench.mkdir(parents=True, exist_ok=True)
        self._log = open(bench / "sglang_requests.jsonl", "a")
        self._lock = threading.Lock()
        atexit.register(self.close)

    # ------------------------------------------------------------------ servers

    def _sp(self, max_new_tokens: int) -> dict:
        return {
            "max_new_tokens": int(max_new_tokens),
            "temperature": float(self.cfg.bench.temperature),
            "stop_token_ids": self.eos_ids,
        }

    def url(self, setting: Setting | None) -> str:
        """The server for the baseline (None) or one speculative setting, started when bench.sglang.launch."""
        bc = self.cfg.bench
        key = "baseline" if setting is None else setting.key
        if setting is None and bc.sglang.baseline_url:
            url = bc.sglang.baseline_url.rstrip("/")
            si = self._info(key, url)
            if si.speculative:
                raise SGLangError(
                    f"bench.sglang.baseline_url {url} runs {si.raw.get('speculative_algorithm')}: the baseline must be plain"
                )
            return url
        given = self._given_speculative()
        if setting is not None and given:
            if key in given:
                url, self.infos[key], _ = given[key]
                return url
            if not bc.sglang.launch:
                listed = "; ".join(f"{u} serves {what}" for u, _, what in given.values())
                raise SGLangError(
                    f"no server given for EAGLE3 {setting.key} ({listed}): add it to bench.sglang.speculative_urls, or set "
                    "bench.sglang.launch to start it"
                )
        if not bc.sglang.launch:
            raise SGLangError(
                f"no server for {key}: set bench.{'baseline' if setting is None else 'speculative'}_url or "
                "bench.sglang.launch: true"
            )
        return self._launch(key, setting)

    def _given_speculative(self) -> dict[str, tuple[str, dict, str]]:
        """bench.sglang.speculative_url and bench.sglang.speculative_urls by what each serves, read from /server_info once: an EAGLE3
        server under its setting key ("3/1/4"), a DFLASH one under its block's ("15/1/16"), anything else under its
        algorithm and numbers -> (url, server info, what it serves)."""
        if self._given is None:
            bc = self.cfg.bench
            self._given = {}
            for url in [
                u.rstrip("/")
                for u in ([bc.sglang.speculative_url] if bc.sglang.speculative_url else []) + bc.sglang.speculative_urls
            ]:
                raw = server_info(url).raw
                have = "/".join(
                    str(raw.get(f"speculative_{k}")) for k in ("num_steps", "eagle_topk", "num_draft_tokens")
                )
                algorithm = raw.get("speculative_algorithm")
                what = f"{algorithm} {have}"
                if algorithm == "DFLASH":  # reports steps 1; its setting here is the block's, B-1/1/B
                    B = int(raw["speculative_num_draft_tokens"])
                    have = f"{B - 1}/1/{B}"
                self._given[have if algorithm in ("EAGLE3", "DFLASH") else what] = (url, raw, what)
        return self._given

    def _info(self, key: str, url: str):
        si = server_info(url)
        self.infos[key] = si.raw
        return si

    def _launch(self, key: str, setting: Setting | None) -> str:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so close() runs (atexit) and stops the servers
        if key in self.launched:
            self.launched[key] = self.launched.pop(key)  # most recently used last
            return self.launched[key].url
        limit = self.cfg.serve.max_servers
        while limit and len(self.launched) >= limit:
            self.launched.pop(next(iter(self.launched))).stop()
        port = self._ports.setdefault(key, self.cfg.serve.port + len(self._ports))
        if setting is None:
            server = server_for(self.cfg, self.run_dir, "baseline", port)
        else:
            server = server_for(self.cfg, self.run_dir, "speculative", port, self.drafter.path, setting)
        server.start()
        try:
            server.wait_healthy()
        except BaseException:
            server.stop()
            raise
        self.launched[key] = server
        self.server_logs[key] = server.log_file
        self._info(key, server.url)
        return server.url

    def close(self) -> None:
        for s in self.launched.values():
            s.stop()
        self.launched.clear()
        if not self._log.closed:
            self._log.close()

    def flush_cache(self, url: str) -> None:
        try:
            requests.post(url + "/flush_cache", timeout=30)
        except requests.RequestException:
            pass

    # ------------------------------------------------------------------ passes

    def _one(self, url: str, i: int, ids: list[int], max_new: int, key: str) -> RequestResult:
        """bench.sglang.requests in order for one prompt: a non-streamed request ("whole", timed by wall as a user's
        client sees it) and/or a streamed one ("stream": its events give the prefill, the decode alone and the
        answer's spans)."""
        kinds, sp, whole = self.cfg.bench.sglang.requests, self._sp(max_new), None
        for kind in kinds:
            if kind == "whole":
                meta, out, wall = whole_generate(url, ids, sp, self.timeout_s)
                whole = {
                    "new_tokens": int(meta.get("completion_tokens", len(out))),
                    "wall_s": wall,
                    "output_ids": out,
                    "verify_count": meta.get("spec_verify_ct"),
                    "finished": finished(meta),
                    "e2e_latency": meta.get("e2e_latency"),
                }
                self._record(key, i, "whole", meta, wall=wall)
        if "stream" not in kinds:  # the whole request is the only one: its wall time stands for the decode too
            acc = accept_lengths_from(meta, whole["new_tokens"])
            return RequestResult(
                prompt_index=i,
                prompt_tokens=int(meta.get("prompt_tokens", len(ids))),
                new_tokens=whole["new_tokens"],
                prefill_s=0.0,
                decode_s=wall,
                output_ids=out,
                verify_count=int(meta["spec_verify_ct"]) if acc is not None else None,
                accept_lengths=acc,
                wall_s=wall,
                finished=whole["finished"],
                whole=whole,
            )
        st = stream_generate(url, ids, sp, self.timeout_s)
        n = int(st.meta.get("completion_tokens", len(st.output_ids)))
        acc = accept_lengths_from(st.meta, n)
        self._record(key, i, "stream", st.meta, prefill_s=st.prefill_s, decode_s=st.decode_s, wall=st.wall_s)
        return RequestResult(
            prompt_index=i,
            prompt_tokens=int(st.meta.get("prompt_tokens", len(ids))),
            new_tokens=n,
            prefill_s=st.prefill_s,
            decode_s=st.decode_s,
            output_ids=st.output_ids,
            verify_count=int(st.meta["spec_verify_ct"]) if acc is not None else None,
            accept_lengths=acc,
            wall_s=st.wall_s,
            finished=finished(st.meta),
            events=st.events,
            whole=whole,
        )

    def _record(self, key: str, i: int, kind: str, meta: dict, **times) -> None:
        """One request's meta_info spec fields and timings into RUN/bench/sglang_requests.jsonl."""
        spec = {k: v for k, v in meta.items() if k.startswith("spec_")}
        row = {"setting": key, "prompt_index": i, "request": kind, "completion_tokens": meta.get("completion_tokens")}
        with self._lock:
            self._log.write(
                json_text({**row, **times, "e2e_latency": meta.get("e2e_latency"), **spec}, self._log.name) + "\n"
            )
            if "spec_accept_length" in spec and kind == self.cfg.bench.sglang.requests[-1]:
                self.request_tau.setdefault(key, []).append(float(spec["spec_accept_length"]))

    def _pass(self, setting: Setting | None, prompts: list[list[int]], max_new: int, first: int) -> list[RequestResult]:
        url = self.url(setting)
        key = "baseline" if setting is None else setting.key
        if self.cfg.bench.sglang.flush_cache == "pass":
            self.flush_cache(url)
        results = [self._one(url, i, p, max_new, key) for i, p in enumerate(prompts, first)]
        self._log.flush()
        if setting is not None:
            tau = server_info(url).avg_spec_accept_length
            if tau is not None:
                self.server_tau.setdefault(key, []).append(tau)
        return results

    def run_baseline(self, prompts: list[list[int]], max_new_tokens: int, first_index: int = 0) -> list[RequestResult]:
        return self._pass(None, prompts, max_new_tokens, first_index)

    def run_speculative(
        self, prompts: list[list[int]], setting: Setting, max_new_tokens: int, first_index: int = 0
    ) -> list[RequestResult]:
        return self._pass(setting, prompts, max_new_tokens, first_index)

    def throughput(self, setting: Setting | None, prompts: list[list[int]], max_new: int, concurrency: int) -> dict:
        """All prompts with `concurrency` requests in flight: output tok/s over the wall time."""
        url = self.url(setting)
        self.flush_cache(url)
        policy = HTTPPolicy(timeout_s=self.timeout_s, retries=0)
        metas: list[dict] = []

        def one(ids):
            body, _, _ = call(
                url, "/generate", {"input_ids": ids, "sampling_params": self._sp(max_new)}, policy, what="bench request"
            )
            return body["meta_info"]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            metas = list(pool.map(one, prompts))
        wall = time.perf_counter() - t0
        tokens = sum(int(m["completion_tokens"]) for m in metas)
        verifies = sum(int(m.get("spec_verify_ct") or 0) for m in metas)
        return {
            "wall_s": wall,
            "new_tokens": tokens,
            "tok_s": tokens / wall,
            "tau": tokens / verifies if verifies else None,
        }

    # ------------------------------------------------------------------ environment

    def offline_tau(self, prompts: list[list[int]], answers: list[list[int]], settings: list[Setting]) -> dict | None:
        """With bench.sglang.same_prompts: the drafter's offline tau on the plain server's answers (the tokens the live
        runs decoded), the target's features from a copy of the target in this process (eval/offline/same_prompts.py)."""
        if not self.cfg.bench.sglang.same_prompts:
            return None
        from eagle3ft.eval.offline.same_prompts import checkpoint_offline_tau  # loads transformers: only when asked

        return checkpoint_offline_tau(self.cfg.target, self.cfg.eval, self.drafter, prompts, answers, settings)

    def _sampling(self, key: str, raw: dict) -> dict:
        """A speculative server's sampled-verify settings; for a DFLASH server this bench launched, also whether its
        log says it verified greedily instead (0.5.17 does so, with one warning, where sgl_kernel's sampling ops are
        missing: speculative/dflash_worker_v2.py _validate_phase1_sampling_support); null for a server given by URL."""
        out = sampling_settings(raw)
        if raw.get("speculative_algorithm") == "DFLASH":
            log = self.server_logs.get(key)
            out["greedy_fallback"] = None if log is None else DFLASH_GREEDY_FALLBACK in read_log(log)
        return out

    def environment(self) -> dict:
        servers = {}
        for key, raw in self.infos.items():
            servers[key] = {"version": raw.get("version"), **{k: raw[k] for k in SERVER_ARGS_KEPT if k in raw}}
        taus = {}
        for key in sorted(set(self.server_tau) | set(self.request_tau)):
            req = self.request_tau.get(key, [])
            taus[key] = {
                "server_avg_spec_accept_length": self.server_tau.get(key),
                "request_spec_accept_length_mean": statistics.mean(req) if req else None,
            }
        sampled = {}  # at T > 0 the verify rule's settings move tau: each speculative server's, None where unreported
        if self.cfg.bench.temperature > 0:
            sampled = {k: self._sampling(k, raw) for k, raw in self.infos.items() if raw.get("speculative_algorithm")}
        return {
            **base_environment(),
            "backend": self.name,
            "nvidia_smi": gpu_clocks(),
            "servers": servers,
            "speculative_sampling": sampled,
            "sglang_tau": taus,
            "launch_env": {k: v for k, v in {**os.environ, **self.cfg.serve.env}.items() if k.startswith(ENV_PREFIXES)},
            "launched": {k: s.command.shell() for k, s in self.launched.items()},
        }


def run_concurrency(
    bench: BenchConfig,
    run_dir: Path,
    backend: SGLangBackend,
    prompts: list[list[int]],
    log: Callable[[str], None] = print,
) -> dict | None:
    """bench.concurrency levels above 1: baseline and every setting interleaved per repetition."""
    levels = sorted({c for c in bench.concurrency if c > 1})
    if not levels:
        return None
    out: dict = {"levels": {}}
    for c in levels:
        rows: dict[str, list[dict]] = {}
        for rep in range(bench.repetitions):
            for s in [None, *bench.settings]:
                key = "baseline" if s is None else s.key
                r = backend.throughput(s, prompts, bench.max_new_tokens, c)
                rows.setdefault(key, []).append(r)
                log(f"  concurrency {c} rep {rep} {key:<11} {r['tok_s']:8.1f} tok/s")
        base = statistics.median(r["tok_s"] for r in rows["baseline"])
        out["levels"][str(c)] = {
            key: {
                "tok_s": spread([r["tok_s"] for r in rs]),
                "speedup_median": statistics.median(r["tok_s"] for r in rs) / base,
                "tau": rs[-1]["tau"],
                "runs": rs,
            }
            for key, rs in rows.items()
        }
    path = RunDir(run_dir).bench / "concurrency.json"
    write_json(path, out, indent=2)
    return out


if __name__ == "__main__":  # the older door, kept for scripts: an alias of `eagle3ft bench` with bench.backend sglang
    from eagle3ft.commands import main

    main(["bench", *sys.argv[1:], "--set", "bench.backend=sglang"])
