"""`eagle3ft sglang-check --url URL`: what a running SGLang server is, in a few lines, before a harvest or bench
uses it: its version and whether this product supports it, the aux layer ids it captures, and whether hidden
states come back (one 1-token /generate with return_hidden_states, its rows' width shown).

Exit status 0 when the version is supported and hidden states come back, 1 otherwise.
"""

from __future__ import annotations

import argparse

import requests

from eagle3ft.targets import sglang_versions
from eagle3ft.targets.sglang_http import HTTPPolicy, SGLangError, server_info


def _draft_ids(path: str | None) -> str:
    if not path:
        return "?"
    from eagle3ft.targets.sglang_server import LaunchError, drafter_aux_ids

    try:
        return str(drafter_aux_ids(path))
    except (LaunchError, OSError, ValueError):
        return "its config.json's eagle_aux_hidden_state_layer_ids (folder not readable here)"


def _hidden_rows(url: str, policy: HTTPPolicy) -> tuple[int, int] | str:
    """(rows, width) of one short request's hidden states, or why there are none."""
    payload = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_hidden_states": True,
    }
    try:
        resp = requests.post(url + "/generate", json=payload, timeout=policy.timeout_s)
    except requests.RequestException as e:
        return f"the request failed: {type(e).__name__}"
    if resp.status_code != 200:
        return f"/generate answered HTTP {resp.status_code}: {resp.text[:200]}"
    body = resp.json()
    hs = (body.get("meta_info") or {}).get("hidden_states") if isinstance(body, dict) else None
    if not hs:
        return "none in the answer"
    first = hs[0]
    block = first if first and isinstance(first[0], list) else [first]
    return len(block) + len(hs) - 1, len(block[0])


def report(url: str, policy: HTTPPolicy | None = None) -> tuple[list[str], bool]:
    """The lines `sglang-check` prints, and whether the server is fit (supported version, hidden states back)."""
    policy = policy or HTTPPolicy(timeout_s=30.0, retries=1, backoff_s=0.5)
    si = server_info(url.rstrip("/"), policy)
    raw, v = si.raw, ".".join(map(str, si.version))
    known = sglang_versions.nearest(si.version)
    lines = []
    if known is not None:
        lines.append(
            f"SGLang {raw['version']} at {si.url}: supported (checked {known.checked}); serve.sglang_version: {v}"
        )
    else:
        lines.append(
            f"SGLang {raw['version']} at {si.url}: NOT supported (supported: {', '.join(sglang_versions.SUPPORTED)}); "
            "its flags and meta_info keys are unchecked: install a supported version, or build its table "
            "(benchmarks/sglang_cli_options.py) before a harvest"
        )
    if si.aux_capture_ids is not None or raw.get("enable_return_aux_hidden_states"):
        ids = si.aux_capture_ids
        lines.append(f"aux capture: layers {ids if ids is not None else 'the model default'} without a draft model")
    elif si.speculative:
        draft = raw.get("speculative_draft_model_path")
        lines.append(f"aux capture: the EAGLE3 draft's layers {_draft_ids(draft)} (draft {draft})")
    else:
        lines.append("aux capture: none (a plain server: hidden states are the last layer, fit for no harvest)")
    rows = _hidden_rows(si.url, policy) if raw.get("enable_return_hidden_states") else None
    if rows is None:
        lines.append("hidden states: not returned (start the server with --enable-return-hidden-states)")
    elif isinstance(rows, str):
        lines.append(f"hidden states: not returned ({rows})")
    else:
        kind = "the aux layers concatenated" if si.returns_aux else "the last layer"
        lines.append(f"hidden states: returned, {rows[0]} rows of width {rows[1]} ({kind})")
    if si.speculative:
        running = raw.get("max_running_requests")
        sampled = ", ".join(
            f"{k.removeprefix('speculative_')} {x}"
            for k, x in sglang_versions.sampling_settings(raw).items()
            if x is not None
        )
        lines.append(
            f"speculative: EAGLE3, max_running_requests {running}; sampled verification: {sampled or 'unreported'}"
        )
    return lines, known is not None and isinstance(rows, tuple)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    ap.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    args = ap.parse_args(argv)
    try:
        lines, ok = report(args.url)
    except SGLangError as e:
        print(f"{args.url}: {e}")
        return 1
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
