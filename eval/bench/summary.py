"""A bench's raw runs (runs.jsonl's rows) summed up: per pass kind the median and min-max tok/s, tau, the seconds per
verify / draft forward / cycle, and the measured cost model the economics prices settings with."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict

from eagle3ft.eval.bench.backend import RequestResult
from eagle3ft.eval.bench.live_splits import arm_figures, spread
from eagle3ft.setting import Setting


def _median(xs: list[float]) -> float | None:
    """Per-cycle times have a long tail (a collection pause, a clock ramp): the median is what a cycle costs."""
    return statistics.median(xs) if xs else None


def pass_tok_s(results: list[RequestResult]) -> float:
    """Decode tok/s of one pass over the prompts: all decoded tokens over all decode time."""
    return sum(r.new_tokens - 1 for r in results) / sum(r.decode_s for r in results)


def summarize(runs: list[dict], settings: list[Setting], verify_curve: dict[int, float] | None) -> dict:
    """Aggregate raw runs (dicts of RequestResult fields plus mode/setting/repetition)."""

    def passes(mode: str, key: str | None) -> dict[int, list[RequestResult]]:
        by: dict[int, list[RequestResult]] = {}
        for r in runs:
            if r["mode"] == mode and r["setting"] == key:
                by.setdefault(r["repetition"], []).append(
                    RequestResult(**{k: r[k] for k in RequestResult.__dataclass_fields__ if k in r})
                )
        return by

    base = passes("baseline", None)
    base_rows = [r for r in runs if r["mode"] == "baseline" and r["setting"] is None]
    base_by_rep = {rep: pass_tok_s(v) for rep, v in sorted(base.items())}
    base_tok_s = list(base_by_rep.values())
    base_s_per_token = statistics.median(1 / t for t in base_tok_s)
    baseline_outputs = {(r.prompt_index): r.output_ids for v in base.values() for r in v}
    spec_rows, draft_fwd, overheads, run_verify, blocks = [], [], [], {}, []
    for st in settings:
        sp = passes("speculative", st.key)
        if not sp:
            continue
        allr = [r for v in sp.values() for r in v]
        acc = [a for r in allr for a in (r.accept_lengths or [])]
        verifies = sum(r.verify_count or 0 for r in allr)
        by_rep = {rep: pass_tok_s(v) for rep, v in sorted(sp.items())}
        tok_s = list(by_rep.values())
        paired = [t / base_by_rep[rep] for rep, t in by_rep.items() if rep in base_by_rep]
        cycles = {  # per repetition: decode time / verifies, the mean cycle
            rep: sum(r.decode_s for r in v) / sum(r.verify_count or 0 for r in v)
            for rep, v in sorted(sp.items())
            if any(r.verify_count for r in v)
        }
        per_pass = list(cycles.values())
        cycle_steps = [c * base_by_rep[rep] for rep, c in cycles.items() if rep in base_by_rep]  # cycle / plain step
        verify_s = [t for r in allr for t in (r.verify_s or [])]
        draft_s = [t for r in allr for t in (r.draft_forward_s or [])]
        cycle_s = [t for r in allr for t in (r.cycle_s or [])]
        row = {
            "setting": asdict(st),
            "key": st.key,
            "tok_s": spread(tok_s),
            "tok_s_median": statistics.median(tok_s),
            "speedup_median": statistics.median(tok_s) / statistics.median(base_tok_s),
            # per repetition, this pass's tok/s over the same repetition's plain pass: with bench.interleave prompt
            # the two ran over the same seconds, so a slow spell of the host slows both
            "speedup_paired": spread(paired) if paired else None,
            "tau": sum(acc) / verifies if verifies else None,
            "verify_count": verifies,
            "accept_histogram": {str(k): v for k, v in sorted(Counter(acc).items())},
            "verify_ms": 1e3 * _median(verify_s) if verify_s else None,
            "draft_forward_ms": 1e3 * _median(draft_s) if draft_s else None,
            "cycle_s": _median(cycle_s) if cycle_s else _median(per_pass),  # else: decode time / verifies, per pass
            "cycle_s_per_pass": _median(
                per_pass
            ),  # decode time / verifies: the mean cycle, what tok/s = tau / cycle holds for
            # that mean cycle over the same repetition's plain seconds per token, median over repetitions
            "cycle_plain_steps": _median(cycle_steps),
            "figures": arm_figures(
                [r for r in runs if r["mode"] == "speculative" and r["setting"] == st.key], base_rows
            ),
            "outputs_match_baseline": sum(r.output_ids == baseline_outputs.get(r.prompt_index) for r in allr)
            / len(allr)
            if all(r.output_ids is not None for r in allr)
            else None,
        }
        spec_rows.append(row)
        if draft_s:
            draft_fwd += draft_s
        if verify_s:
            run_verify.setdefault(st.num_draft_tokens, []).extend(verify_s)
        # a DFlash block cycle runs one drafter forward per verify whatever its steps (B - 1): a block setting
        block = bool(verify_s) and st.steps > 1 and len(draft_s) == len(verify_s)
        blocks.append(block)
        if cycle_s and verify_s and draft_s:
            overheads.append(_median(cycle_s) - _median(verify_s) - (1 if block else st.steps) * _median(draft_s))
    if verify_curve or run_verify:
        verify_costs = {**(verify_curve or {}), **{n: _median(v) for n, v in run_verify.items()}}
        source = "verify forwards timed inside the benchmark runs, other sizes from backend.verify_costs"
        draft_forward_s = _median(draft_fwd) or 0.0
        overhead_s = max(0.0, _median(overheads) or 0.0)
    else:
        verify_costs = {r["setting"]["num_draft_tokens"]: r["cycle_s"] for r in spec_rows if r["cycle_s"]}
        source = (
            "whole draft+verify cycle per setting (decode time / verify count, median over passes): draft cost "
            "folded into verify"
        )
        draft_forward_s, overhead_s = 0.0, 0.0
    return {
        "baseline": {
            "tok_s": spread(base_tok_s),
            "tok_s_median": statistics.median(base_tok_s),
            "ms_per_token": 1e3 * base_s_per_token,
            "figures": arm_figures(base_rows, None),
        },
        "speculative": spec_rows,
        "costs": {
            "baseline_s_per_token": base_s_per_token,
            "verify_s": {str(k): v for k, v in sorted(verify_costs.items())},
            "draft_forward_s": draft_forward_s,
            "overhead_s": overhead_s,
            "block": bool(blocks) and all(blocks),  # every setting a DFlash block cycle: one draft forward a cycle
            "source": source,
        },
    }
