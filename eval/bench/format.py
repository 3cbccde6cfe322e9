"""The live bench's summary as console lines: per arm the decode tok/s, the e2e line and the loop/finished split."""

from __future__ import annotations


def _format_figures(f: dict | None, indent: str) -> list[str]:
    """The e2e line and the loop/finished split of one arm (eval/bench/live_splits.py)."""
    if not f:
        return []
    e, lf, fin = f["e2e"], f["loop_free"], f["finished"]
    line = f"{indent}  e2e {e['tok_s']['median']:8.1f} tok/s ({e['tok_s']['min']:.1f}-{e['tok_s']['max']:.1f})"
    if e.get("speedup_median"):
        line += f"  x{e['speedup_median']:.2f}" + (
            f" (paired x{e['speedup_paired']['median']:.2f})" if e.get("speedup_paired") else ""
        )
    out = [line + f"  [{e['timing']}]"]
    share = f"{lf['loop_share']:.0%}" if lf["loop_share"] is not None else "n/a"
    tau_lf = f"{lf['tau']:.2f}" if lf["tau"] else "n/a"
    tau_fin = f"{fin['tau']:.2f}" if fin["tau"] else "n/a"
    fa = f.get("loop_free_answers")  # exact without spans, so also for non-streamed SGLang answers
    looping = fa["of"] - fa["answers"] if fa else lf["answers_looping"]
    no_loop = ""
    if fa and fa.get("tau"):
        no_loop = f"; no loop {fa['answers']}/{fa['of']}, tau {fa['tau']:.2f}" + (
            f", e2e x{fa['speedup_e2e']:.2f}" if fa.get("speedup_e2e") else ""
        )
    out.append(
        f"{indent}  loops: {share} of tokens, {looping} answers loop"
        + (f"; tau loop-free {tau_lf}" if lf["tau"] or f["all"]["verifies"] else "")
        + (f" (decode x{lf['speedup_decode']:.2f})" if lf.get("speedup_decode") else "")
        + f"; finished {fin['answers']}/{fin['of']}"
        + (f", tau {tau_fin}" if f["all"]["verifies"] else "")
        + (f", e2e x{fin['speedup_e2e']:.2f}" if fin.get("speedup_e2e") else "")
        + no_loop
        + (f"; {lf['unresolved']} answers without spans" if lf["unresolved"] else "")
    )
    return out


def _format_rows(rows: list[dict], indent: str = "") -> list[str]:
    lines = []
    for r in rows:
        t = r["tok_s"]
        lines.append(
            f"{indent}spec {r['key']:<7} {t['median']:8.1f} tok/s ({t['min']:.1f}-{t['max']:.1f})  "
            f"x{r['speedup_median']:.2f}"
            + (f" (paired x{r['speedup_paired']['median']:.2f})" if r.get("speedup_paired") else "")
            + f"  tau {r['tau']:.2f}"
            + (f"  verify {r['verify_ms']:.2f} ms  draft fwd {r['draft_forward_ms']:.2f} ms" if r["verify_ms"] else "")
        )
        lines += _format_figures(r.get("figures"), indent)
    return lines


def format_summary(s: dict) -> str:
    sets = s.get("prompt_sets") or {}
    if len(sets) > 1 or any(len(p["drafters"]) > 1 for p in sets.values()):
        lines = []
        for label, p in sets.items():
            b = p["baseline"]["tok_s"]
            lines.append(
                f"{label} ({p['count']} prompts): baseline {b['median']:8.1f} tok/s ({b['min']:.1f}-{b['max']:.1f})"
            )
            for d, v in p["drafters"].items():
                lines.append(f"  drafter {d}")
                lines += _format_rows(v["speculative"], "    ")
        return "\n".join(lines)
    b = s["baseline"]["tok_s"]
    return "\n".join(
        [
            f"baseline     {b['median']:8.1f} tok/s ({b['min']:.1f}-{b['max']:.1f})",
            *_format_figures(s["baseline"].get("figures"), ""),
            *_format_rows(s["speculative"]),
        ]
    )
