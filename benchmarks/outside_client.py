"""Does our live bench agree with SGLang's own client? `sglang.bench_serving` (0.5.17: `sglang.benchmark.serving`)
against the same servers and prompts as `eval/bench/sglang_backend.py`, batch 1, streamed and not, then the two side by side.

    python benchmarks/outside_client.py dataset --config CFG [--set k=v ...] --out PROMPTS.jsonl
        the bench prompts (bench.prompts) as bench_serving's custom dataset: each prompt as our bench renders it
        (chat template applied), as text; checks that the server's tokenizer gives the very ids our bench sends
    python benchmarks/outside_client.py run --arm baseline=URL --arm 8/4/32=URL --dataset PROMPTS.jsonl \
        --tokenizer MODEL_DIR --num-prompts N --output-len 512 --reps 3 --modes whole,stream --out DIR
        bench_serving in this process (one import), --max-concurrency 1, --disable-ignore-eos, T=0, the cache flushed
        before each run; the arms interleaved per repetition (A B A B); DIR/outside.json
    python benchmarks/outside_client.py compare RUN/bench/summary.json DIR/outside.json
        per arm, our e2e tok/s (non-streamed, and the streamed requests' wall) against bench_serving's: total output
        tokens over the summed e2e latency of its requests
    python benchmarks/outside_client.py prompts --config CFG [--set k=v ...] [--num-prompts N] --out P.json
    python benchmarks/outside_client.py alternate --prompts P.json --tokenizer MODEL_DIR --arm baseline=URL \
        --arm 8/4/32=URL [--output-len 512 --reps 1 --clients bench_serving,ours,ours-text] --out DIR
        the two clients alternated request by request (a pass-level comparison drifts with the host, RESULTS §25c):
        per prompt of bench.prompts and per arm, one non-streamed request from each client, in an order that rotates
        with the prompt, each after a cache flush so that all see the server in one state: `bench_serving` (its own
        request function, async_request_sglang_generate, with the namespace its parser builds from the `run` flags),
        `ours` (eval/bench/sglang_requests.py's whole_generate with the bench's payload: input_ids and stop_token_ids) and
        `ours-text` (our client with bench_serving's payload: text, no stop ids), so that a gap splits into client
        and payload; `bench_serving-stream` and `ours-stream` (--clients) are the two clients streamed, their time
        to the first token kept apart (ttft_s). DIR/alternate.jsonl (a row per request) and DIR/alternate.json (`summarize`). With `--clients
        ours` and one arm per drafter (`--arm shipped=URL --arm new=URL`, servers of one setting), it is the
        drafters' comparison interleaved per prompt: tok/s, speed-up, tau and the no-loop answers' tau per arm

The run needs SGLang's PYTHONPATH and the `datasets` package there (bench_serving imports it at start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

CLIENTS = ("bench_serving", "ours", "ours-text")
STREAMED = ("bench_serving-stream", "ours-stream")  # the same, streamed: wall time to the last event, TTFT apart


def dataset(args) -> None:
    """The prompts as rendered text. Not through bench_serving's --apply-chat-template: its custom dataset then strips
    every bos_token from the rendered text, and SmolLM2's bos_token is <|im_start|>, ChatML's turn marker."""
    from eagle3ft.config import load_config
    from eagle3ft.data.render import load_prompts
    from eagle3ft.targets.hf import load_tokenizer

    cfg = load_config(args.config, args.set)
    tok = load_tokenizer(cfg.target)
    ours = load_prompts(cfg.target, tok, cfg.bench.prompts)
    texts = [tok.decode(ids) for ids in ours]
    same = sum(tok(t)["input_ids"] == ids for t, ids in zip(texts, ours))  # as the server tokenizes a text prompt
    with open(args.out, "w") as f:
        for text in texts:
            row = {"conversations": [{"role": "user", "content": text}, {"role": "assistant", "content": "-"}]}
            f.write(json.dumps(row) + "\n")
    print(json.dumps({"prompts": len(texts), "same_ids_as_our_bench": same}))
    if same != len(texts):
        raise SystemExit("outside_client.py: error: the server would tokenize some prompts to other ids than ours")


def _argv(url: str, a, stream: bool, out_file: Path) -> list[str]:
    argv = [
        "bench_serving", "--backend", "sglang", "--base-url", url, "--dataset-name", "custom",
        "--dataset-path", a.dataset, "--num-prompts", str(a.num_prompts), "--sharegpt-output-len", str(a.output_len),
        "--max-concurrency", "1", "--disable-ignore-eos", "--temperature", "0", "--tokenizer", a.tokenizer, "--flush-cache", "--seed", "0", "--output-file", str(out_file),
    ]  # fmt: skip
    return argv + ([] if stream else ["--disable-stream"])


def run(a) -> None:
    from sglang.benchmark.serving import cli_main

    arms = dict(x.split("=", 1) for x in a.arm)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for rep in range(a.reps):
        for mode in a.modes.split(","):
            for arm, url in arms.items():
                f = out / f"bs-{arm.replace('/', '-')}-{mode}-{rep}.jsonl"
                sys.argv = _argv(url, a, mode == "stream", f)
                cli_main()
                res = json.loads(f.read_text().splitlines()[-1])
                e2e_s = res["mean_e2e_latency_ms"] * res["completed"] / 1e3
                rows.append(
                    {
                        "arm": arm,
                        "mode": mode,
                        "repetition": rep,
                        "completed": res["completed"],
                        "output_tokens": res["total_output_tokens"],
                        "e2e_tok_s": res["total_output_tokens"] / e2e_s,
                        "output_throughput": res["output_throughput"],
                        "mean_ttft_ms": res.get("mean_ttft_ms"),
                        "median_itl_ms": res.get("median_itl_ms"),
                        "accept_length": res.get("accept_length"),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    (out / "outside.json").write_text(json.dumps({"arms": arms, "runs": rows}, indent=1))


def _bench_serving(a, url: str, stream: bool = False):
    """(serving module, the args namespace bench_serving's own parser builds for `run`'s flags)."""
    from sglang.benchmark import serving

    got: list = []
    real, serving.run_benchmark = serving.run_benchmark, got.append  # cli_main parses, validates, then calls this
    try:
        sys.argv = _argv(url, a, stream, Path(a.out) / "unused.jsonl")
        serving.cli_main()
    finally:
        serving.run_benchmark = real
    return serving, got[0]


def _request_bench_serving(state, url: str, text: str, ids: list[int], max_new: int) -> dict:
    serving, ns = state
    serving.set_global_args(ns)
    inp = serving.RequestFuncInput(
        prompt=text, api_url=url + "/generate", prompt_len=len(ids), output_len=max_new, model=ns.model or "",
        lora_name=None, image_data=None, extra_request_body={},
    )  # fmt: skip
    out = asyncio.run(serving.async_request_sglang_generate(inp))
    if not out.success:
        raise SystemExit(f"outside_client.py: error: bench_serving's request to {url} failed: {out.error[-300:]}")
    return {"tokens": int(out.output_len), "seconds": out.latency, "ttft_s": out.ttft, "text": out.generated_text}


def _request_ours(eos_ids, url: str, text: str, ids: list[int], max_new: int, timeout_s: float = 600.0) -> dict:
    from eagle3ft.data.loops import loop_mask
    from eagle3ft.eval.bench.sglang_requests import whole_generate

    sp = {"max_new_tokens": max_new, "temperature": 0.0, "stop_token_ids": list(eos_ids)}
    meta, out, wall = whole_generate(url, ids, sp, timeout_s)
    return {"tokens": int(meta["completion_tokens"]), "seconds": wall, "server_s": meta.get("e2e_latency"),
            "verifies": meta.get("spec_verify_ct"), "loops": any(loop_mask(out))}  # fmt: skip


def _request_ours_stream(eos_ids, url: str, text: str, ids: list[int], max_new: int, timeout_s: float = 600.0) -> dict:
    from eagle3ft.data.loops import loop_mask
    from eagle3ft.eval.bench.sglang_requests import stream_generate

    sp = {"max_new_tokens": max_new, "temperature": 0.0, "stop_token_ids": list(eos_ids)}
    r = stream_generate(url, ids, sp, timeout_s)
    return {"tokens": int(r.meta["completion_tokens"]), "seconds": r.wall_s, "ttft_s": r.prefill_s,
            "server_s": r.meta.get("e2e_latency"), "verifies": r.meta.get("spec_verify_ct"),
            "events": len(r.events), "loops": any(loop_mask(r.output_ids))}  # fmt: skip


def _request_ours_text(url: str, text: str, ids: list[int], max_new: int, timeout_s: float = 600.0) -> dict:
    import requests

    t0 = time.perf_counter()
    body = requests.post(
        url + "/generate", json={"text": text, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}},
        timeout=(10.0, timeout_s),
    ).json()  # fmt: skip
    wall = time.perf_counter() - t0
    meta = body["meta_info"]
    return {"tokens": int(meta["completion_tokens"]), "seconds": wall, "server_s": meta.get("e2e_latency"),
            "text": body.get("text")}  # fmt: skip


def alternate_rows(arms: dict[str, str], texts: list[str], ids: list[list[int]], requesters: dict, max_new: int,
                   reps: int, flush, on_row=None) -> list[dict]:  # fmt: skip
    """Per repetition, prompt and arm: one request per client, the clients' order rotated by the prompt, each after
    flush(url)."""
    names, rows = list(requesters), []
    for rep in range(reps):
        for i, (text, pid) in enumerate(zip(texts, ids)):
            k = i % len(names)
            order = names[k:] + names[:k]
            for arm, url in arms.items():
                for pos, client in enumerate(order):
                    flush(url)
                    r = requesters[client](url, text, pid, max_new)
                    rows.append({"rep": rep, "prompt": i, "arm": arm, "client": client, "position": pos, **r})
                    if on_row:
                        on_row(rows[-1])
    return rows


def _ratio_spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else {}


def summarize(rows: list[dict]) -> dict:
    """Per arm and client: tok/s over all requests (tokens / seconds); per arm, each client against bench_serving
    (or the first client): the ratio of the totals, the per-request ratios, and the share of requests whose answer
    had as many tokens; per client, each arm's speed-up over `baseline` and its difference from bench_serving's."""
    clients = list(dict.fromkeys(r["client"] for r in rows))
    ref = "bench_serving" if "bench_serving" in clients else clients[0]
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    by = {(r["rep"], r["prompt"], r["arm"], r["client"]): r for r in rows}
    out: dict = {"reference": ref, "arms": {}}
    tok_s: dict = {}
    for arm in arms:
        a = out["arms"][arm] = {}
        for c in clients:
            mine = [r for r in rows if r["arm"] == arm and r["client"] == c]
            tok_s[arm, c] = sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine)
            a[c] = {"requests": len(mine), "tokens": sum(r["tokens"] for r in mine), "tok_s": tok_s[arm, c]}
            if c.endswith("-stream") and all(r.get("ttft_s") is not None for r in mine):  # decode only, as §23
                a[c]["tok_s_after_first"] = sum(r["tokens"] - 1 for r in mine) / sum(
                    r["seconds"] - r["ttft_s"] for r in mine
                )
            server = [r["server_s"] for r in mine if r.get("server_s")]
            if len(server) == len(mine):
                a[c]["tok_s_server"] = a[c]["tokens"] / sum(server)
            if mine and all(r.get("verifies") for r in mine):  # tau: the tokens after the prefill's, per verify
                a[c]["tau"] = sum(r["tokens"] - 1 for r in mine) / sum(r["verifies"] for r in mine)
                free = [r for r in mine if r.get("loops") is False]
                if free:
                    a[c]["no_loop_answers"] = {
                        "answers": len(free),
                        "tau": sum(r["tokens"] - 1 for r in free) / sum(r["verifies"] for r in free),
                    }
        for c in clients:
            if c == ref:
                continue
            pairs = [
                (r, by.get((r["rep"], r["prompt"], arm, ref))) for r in rows if r["arm"] == arm and r["client"] == c
            ]
            pairs = [(r, q) for r, q in pairs if q]
            same = [(r, q) for r, q in pairs if r["tokens"] == q["tokens"]]
            a[c]["vs_" + ref] = {
                "total": tok_s[arm, c] / tok_s[arm, ref] - 1,
                "per_request": _ratio_spread([(r["tokens"] / r["seconds"]) / (q["tokens"] / q["seconds"]) - 1 for r, q in pairs]),
                "same_length_share": len(same) / len(pairs) if pairs else None,
                "same_length_total": (sum(r["tokens"] for r, _ in same) / sum(r["seconds"] for r, _ in same))
                / (sum(q["tokens"] for _, q in same) / sum(q["seconds"] for _, q in same)) - 1 if same else None,
                "within_5pct": abs(tok_s[arm, c] / tok_s[arm, ref] - 1) <= 0.05,
            }  # fmt: skip
    if "baseline" in arms:
        out["speedup"] = {}
        for arm in arms:
            if arm == "baseline":
                continue
            s = {c: tok_s[arm, c] / tok_s["baseline", c] for c in clients}
            out["speedup"][arm] = {**s, **{f"{c}_vs_{ref}": s[c] / s[ref] - 1 for c in clients if c != ref}}
    return out


def prompts(a) -> None:
    """bench.prompts as the alternation sends them: the token ids, their text, and the bench's stop ids."""
    from eagle3ft.config import load_config
    from eagle3ft.data.chat import ChatFormat
    from eagle3ft.data.render import load_prompts
    from eagle3ft.targets.hf import load_tokenizer

    cfg = load_config(a.config, a.set)
    tok = load_tokenizer(cfg.target)
    ids = load_prompts(cfg.target, tok, cfg.bench.prompts)[: a.num_prompts or None]
    texts = [tok.decode(p) for p in ids]
    if any(tok(t)["input_ids"] != p for t, p in zip(texts, ids)):
        raise SystemExit("outside_client.py: error: a text prompt would tokenize to other ids than the bench sends")
    stop = ChatFormat(tok, cfg.target.chat_template).stop_ids
    Path(a.out).write_text(json.dumps({"texts": texts, "ids": ids, "stop_ids": stop}))
    print(json.dumps({"prompts": len(ids), "stop_ids": stop}))


def alternate(a) -> None:
    """Needs no transformers of its own: SGLang's PYTHONPATH brings the version SGLang pins."""
    import requests

    p = json.loads(Path(a.prompts).read_text())
    texts, ids, eos = p["texts"], p["ids"], p["stop_ids"]
    arms = dict(x.split("=", 1) for x in a.arm)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    requesters = {
        "ours": lambda url, text, pid, n: _request_ours(eos, url, text, pid, n),
        "ours-text": _request_ours_text,
        "ours-stream": lambda url, text, pid, n: _request_ours_stream(eos, url, text, pid, n),
    }
    for c in {"bench_serving", "bench_serving-stream"} & set(a.clients.split(",")):  # its parser wants `run`'s
        a.dataset, a.num_prompts = "unused.jsonl", len(ids)  # flags; it reads no dataset here
        st = {url: _bench_serving(a, url, stream=c.endswith("-stream")) for url in arms.values()}
        requesters[c] = lambda url, *r, st=st: _request_bench_serving(st[url], url, *r)
    unknown = set(a.clients.split(",")) - set(requesters)
    if unknown:
        raise SystemExit(
            f"outside_client.py: error: --clients: unknown {sorted(unknown)}; known: {list(CLIENTS + STREAMED)}"
        )
    requesters = {c: requesters[c] for c in a.clients.split(",")}
    log = open(out / "alternate.jsonl", "w")

    def on_row(r):
        log.write(json.dumps({k: v for k, v in r.items() if k != "text"}) + "\n")
        log.flush()

    rows = alternate_rows(arms, texts, ids, requesters, a.output_len, a.reps,
                          lambda url: requests.post(url + "/flush_cache", timeout=30), on_row)  # fmt: skip
    log.close()
    summary = {"prompts": len(ids), "reps": a.reps, "output_len": a.output_len, "arms_urls": arms, **summarize(rows)}
    (out / "alternate.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


def compare(summary_path: str, outside_path: str) -> dict:
    """Per arm and mode: our median e2e tok/s, bench_serving's, and the difference."""
    s = json.loads(Path(summary_path).read_text())
    theirs = json.loads(Path(outside_path).read_text())["runs"]
    ours = {"baseline": s["baseline"]["figures"], **{r["key"]: r["figures"] for r in s["speculative"]}}
    out = {}
    for arm, f in ours.items():
        for mode, key in (("whole", "e2e"), ("stream", "stream_wall")):
            t = [r["e2e_tok_s"] for r in theirs if r["arm"] == arm and r["mode"] == mode]
            if not t or key not in f:
                continue
            o, m = f[key]["tok_s"]["median"], statistics.median(t)
            out[f"{arm} {mode}"] = {
                "ours": o,
                "bench_serving": m,
                "diff": o / m - 1,
                "within_5pct": abs(o / m - 1) <= 0.05,
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dataset")
    d.add_argument("--config", required=True)
    d.add_argument("--set", action="append", default=[])
    d.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--arm", action="append", required=True, help="label=URL; baseline for the plain server")
    r.add_argument("--dataset", required=True)
    r.add_argument("--tokenizer", required=True)
    r.add_argument("--num-prompts", type=int, required=True)
    r.add_argument("--output-len", type=int, default=512)
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--modes", default="whole,stream")
    r.add_argument("--out", required=True)
    pr = sub.add_parser("prompts")
    pr.add_argument("--config", required=True)
    pr.add_argument("--set", action="append", default=[])
    pr.add_argument("--num-prompts", type=int, default=0, help="the first N of bench.prompts (0: all)")
    pr.add_argument("--out", required=True)
    al = sub.add_parser("alternate")
    al.add_argument("--prompts", required=True, help="the file of `prompts`")
    al.add_argument("--arm", action="append", required=True, help="label=URL; baseline for the plain server")
    al.add_argument("--clients", default=",".join(CLIENTS), help=f"comma-separated, of {', '.join(CLIENTS + STREAMED)}")
    al.add_argument("--output-len", type=int, default=512)
    al.add_argument("--reps", type=int, default=1)
    al.add_argument("--out", required=True)
    al.add_argument("--tokenizer", required=True, help="the served model's folder, for bench_serving's parser")
    c = sub.add_parser("compare")
    c.add_argument("summary")
    c.add_argument("outside")
    a = ap.parse_args()
    if a.cmd == "dataset":
        dataset(a)
    elif a.cmd == "run":
        run(a)
    elif a.cmd == "prompts":
        prompts(a)
    elif a.cmd == "alternate":
        alternate(a)
    else:
        print(json.dumps(compare(a.summary, a.outside), indent=1))


if __name__ == "__main__":
    main()
