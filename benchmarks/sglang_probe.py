"""Probe a real SGLang server for the wire facts the client and the protocol double rely on.

Each fact is a relation that does not depend on the model (rows - prompt - new, entry nesting,
null positions, field names), so a real server and tests/sglang_double.py can be compared
fact by fact on the same kind of server:

    python benchmarks/sglang_probe.py --url http://127.0.0.1:30000 --hidden-size 576 [--out facts.json]
    python benchmarks/sglang_probe.py --double plain|eagle3|aux --hidden-size 64   # the double, tiny model
    python benchmarks/sglang_probe.py --compare real.json double.json                # differing facts, exit 1 if any

The first file of --compare is the reference: its facts are compared, and a fact only the second
has (one added to the probe after the reference was recorded) is listed, not counted as a difference.
Recorded real facts: tests/fixtures/sglang-0.5.17/ (tests/test_sglang_fixtures.py holds the double to them).

Requests sent: the client's capture request (hidden states + top-k logprobs from position 0),
prefill-only (max_new_tokens 0), a streamed generation, /server_info, /get_server_info,
/health, /flush_cache, then /server_info again (its internal state after requests).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import requests

PROMPT = [1, 504, 3458, 314, 260, 3575, 282, 4238, 30, 2]  # any ids below every vocabulary used here
K = 5
NEW = 12


def _depth(x) -> int:
    d = 0
    while isinstance(x, list) and x:
        d += 1
        x = x[0]
    return d


def _get(url: str, path: str):
    try:
        r = requests.get(url + path, timeout=30)
    except requests.RequestException as e:
        return None, str(e)
    return r.status_code, r


def facts(url: str, hidden_size: int) -> dict:
    url = url.rstrip("/")
    f: dict = {}
    code, r = _get(url, "/health")
    f["health_status"] = code
    for path in ("/server_info", "/get_server_info"):
        code, r = _get(url, path)
        f[f"{path}_status"] = code
        if code == 200 and "server_info_keys_used" not in f:
            info = r.json()
            f["version"] = info.get("version")
            f["server_info_keys_used"] = sorted(
                k
                for k in (
                    "version",
                    "enable_return_hidden_states",
                    "speculative_algorithm",
                    "speculative_num_steps",
                    "speculative_eagle_topk",
                    "speculative_num_draft_tokens",
                    "speculative_draft_model_path",
                    "enable_return_aux_hidden_states",
                    "return_aux_hidden_state_layer_ids",
                    "internal_states",
                )
                if k in info
            )
            states = info.get("internal_states") or [{}]
            f["internal_states_has_avg_spec_accept_length"] = "avg_spec_accept_length" in states[0]
            speculative = bool(info.get("speculative_algorithm"))
    info_path = next((p for p in ("/server_info", "/get_server_info") if f[f"{p}_status"] == 200), None)
    f["flush_cache_status"] = requests.post(url + "/flush_cache", timeout=30).status_code

    req = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0},
        "return_hidden_states": True,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": K,
    }
    r = requests.post(url + "/generate", json=req, timeout=300)
    f["capture_status"] = r.status_code
    if r.status_code == 200:
        body = r.json()
        meta = body["meta_info"]
        n = int(meta["completion_tokens"])
        P = len(PROMPT)
        hs = meta.get("hidden_states")
        f["top_level_keys"] = sorted(body)
        f["meta_keys"] = sorted(k for k in meta if not k.startswith("spec_") and k not in ("e2e_latency",))
        f["spec_keys"] = sorted(k for k in meta if k.startswith("spec_"))
        f["finish_reason_keys"] = (
            sorted(meta["finish_reason"])
            if isinstance(meta.get("finish_reason"), dict)
            else repr(meta.get("finish_reason"))
        )
        f["output_ids_len_minus_completion_tokens"] = len(body["output_ids"]) - n
        f["prompt_tokens_minus_P"] = meta["prompt_tokens"] - P
        if hs is not None:
            f["hidden_entries_minus_completion_tokens"] = len(hs) - n
            f["hidden_first_entry_depth"] = _depth(hs[0])
            f["hidden_first_entry_rows_minus_P"] = len(hs[0]) - P
            f["hidden_decode_entry_depths"] = sorted({_depth(e) for e in hs[1:]})
            f["hidden_decode_entry_rows"] = sorted({len(e) if _depth(e) == 2 else 1 for e in hs[1:]})
            width = len(hs[0][0])
            f["hidden_width_over_hidden_size"] = width / hidden_size
            rows = len(hs[0]) + sum(len(e) if _depth(e) == 2 else 1 for e in hs[1:])
            f["hidden_rows_minus_P_minus_new"] = rows - P - n
        inp, outp = meta.get("input_top_logprobs"), meta.get("output_top_logprobs")
        if inp is not None:
            f["input_top_len_minus_P"] = len(inp) - P
            f["input_top_first_is_null"] = inp[0] is None
            f["input_top_entry_len_minus_K"] = len(inp[1]) - K
            f["top_triple_len"] = len(inp[1][0])
            f["top_triple_third"] = repr(inp[1][0][2])
            f["top_sorted_descending"] = all(e[j][0] >= e[j + 1][0] for e in inp[1:] for j in range(K - 1))
            f["output_top_len_minus_new"] = len(outp) - n
            f["input_token_logprobs_first"] = repr(meta["input_token_logprobs"][0][0])
        if f["spec_keys"]:
            # 0.5.23 sends only spec_correct_drafts_histogram; 0.5.17 also its old twin spec_accept_histogram
            hist = meta.get("spec_correct_drafts_histogram") or meta.get("spec_accept_histogram")
            f["spec_accept_length_is_completion_over_verify"] = (
                abs(meta["spec_accept_length"] - n / meta["spec_verify_ct"]) < 1e-6
            )
            f["spec_histogram_sum_minus_verify_ct"] = (sum(hist) - meta["spec_verify_ct"]) if hist else None
    r0 = requests.post(
        url + "/generate", json={**req, "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}, timeout=300
    )
    f["prefill_only_status"] = r0.status_code
    if r0.status_code == 200:
        m0 = r0.json()["meta_info"]
        f["prefill_only_completion_tokens"] = m0["completion_tokens"]
        f["prefill_only_hidden_entries"] = len(m0.get("hidden_states") or [])
        f["prefill_only_output_top_len"] = len(m0.get("output_top_logprobs") or [])
        f["prefill_only_output_token_len"] = len(m0.get("output_token_logprobs") or [])
    events, cumulative, final_spec = [], True, False
    with requests.post(
        url + "/generate",
        json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW, "temperature": 0.0}, "stream": True},
        stream=True,
        timeout=300,
    ) as rs:
        f["stream_status"] = rs.status_code
        for line in rs.iter_lines():
            if line.startswith(b"data:"):
                events.append(line[5:].strip())
    f["stream_ends_with_done"] = bool(events) and events[-1] == b"[DONE]"
    parsed = [json.loads(e) for e in events if e != b"[DONE]"]
    if parsed:
        for ev in parsed:
            cumulative &= len(ev["output_ids"]) == ev["meta_info"]["completion_tokens"]
        f["stream_output_ids_cumulative"] = cumulative
        f["stream_finish_reason_null_until_last"] = (
            all(e["meta_info"].get("finish_reason") is None for e in parsed[:-1])
            and parsed[-1]["meta_info"].get("finish_reason") is not None
        )
        final_spec = any(k.startswith("spec_") for k in parsed[-1]["meta_info"])
        f["stream_last_event_has_spec_fields"] = final_spec
        f["stream_events_minus_completion_tokens_when_plain"] = (
            (len(parsed) - parsed[-1]["meta_info"]["completion_tokens"]) if not speculative else None
        )
    if info_path:
        states = _get(url, info_path)[1].json().get("internal_states") or [{}]
        f["internal_states_has_avg_spec_accept_length_after_requests"] = "avg_spec_accept_length" in states[0]
    return f


def double_facts(kind: str, hidden_size_check: int, version: str | None = None) -> dict:
    """The facts of the double serving the tiny target as `kind` (plain, eagle3, aux), playing `version` (default:
    0.5.23 for aux, the only one with it, else 0.5.17)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import torch
    from sglang_double import DoubleEngine, SGLangDouble

    from eagle3ft.config import REPO_ROOT, load_config
    from eagle3ft.drafter.config import DrafterConfig
    from eagle3ft.drafter.model import Eagle3Drafter
    from eagle3ft.targets.hf import load_target

    cfg = load_config(REPO_ROOT / "configs/tiny.yaml")
    model, tok = load_target(cfg.target)
    if hidden_size_check != model.config.hidden_size:
        raise SystemExit(f"--hidden-size {hidden_size_check}: the tiny target's is {model.config.hidden_size}")
    if kind == "eagle3":
        torch.manual_seed(0)
        d = Eagle3Drafter(DrafterConfig.from_json(REPO_ROOT / cfg.drafter.config))
        d.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
        engine, default = DoubleEngine(model, tok, drafter=d.eval()), "0.5.17"
    elif kind == "aux":
        engine, default = DoubleEngine(model, tok, aux_layer_ids=[0, 1, 2]), "0.5.23"
    else:
        engine, default = DoubleEngine(model, tok), "0.5.17"
    with SGLangDouble(engine, version=version or default) as double:
        return facts(double.url, model.config.hidden_size)


FINISH_REASON_SHAPES = (["length", "type"], ["matched", "type"])


def model_independent(f: dict) -> dict:
    """The facts as compared. finish_reason's keys depend on the model: {type: stop, matched} when
    it emitted a stop token within NEW tokens (SmolLM2-135M did on the H200), {type: length, length}
    when it did not (the tiny test model does not); what does not depend on it is that the keys are
    one of these two shapes."""
    g = dict(f)
    keys = g.get("finish_reason_keys")
    if keys in FINISH_REASON_SHAPES:
        g["finish_reason_keys"] = "one of " + " | ".join(map(str, FINISH_REASON_SHAPES))
    return g


def compare(ref: dict, other: dict) -> list[str]:
    """Facts of the reference `ref` that `other` differs on (or lacks); the version is not a fact."""
    a, b = model_independent(ref), model_independent(other)
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in sorted(a) if k != "version" and a.get(k) != b.get(k)]


def unrecorded(ref: dict, other: dict) -> list[str]:
    """Facts `other` has that the reference was recorded without."""
    return sorted(set(other) - set(ref))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url")
    ap.add_argument("--double", choices=["plain", "eagle3", "aux"])
    ap.add_argument("--hidden-size", type=int)
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        ref, other = (json.loads(Path(p).read_text()) for p in args.compare)
        diff = compare(ref, other)
        print("\n".join(diff) if diff else "all facts agree")
        for k in unrecorded(ref, other):
            print(f"not in the reference (not compared): {k} = {other[k]!r}")
        raise SystemExit(1 if diff else 0)
    if not args.hidden_size or not (args.url or args.double):
        ap.error("--hidden-size and one of --url / --double")
    f = facts(args.url, args.hidden_size) if args.url else double_facts(args.double, args.hidden_size)
    text = json.dumps(f, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
