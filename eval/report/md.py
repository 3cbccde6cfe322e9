"""report.md from the report dict that eval/report/build.py builds: the headline, the verdict, the terms, then Training,
Offline accept length, Live benchmark and Economics, in that order.
"""

from __future__ import annotations

from eagle3ft.train.metrics import DIVERGED


def _f(x, fmt="{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


TERMS = (
    "How to read it: **τ** (accept length) is the number of tokens one draft+verify cycle emits, the bonus token "
    "included (SGLang's `spec_accept_length`): 1.0 means no draft was accepted. A **setting** steps/topk/draft tokens "
    "is SGLang's `--speculative-num-steps` / `--speculative-eagle-topk` / `--speculative-num-draft-tokens`. "
    "**Draft tokens** counts the root, the last verified token the cycle starts from: 3/1/4 drafts 3 tokens and "
    "verifies 4 positions, so a chain's τ is at most steps + 1 (4 here). The **break-even τ** is the cycle time over "
    "one plain decoding step: above it speculation is faster than plain decoding, below it slower."
)


def _describe_source(src: dict | None) -> str:
    if not src:
        return "?"
    what = src.get("kind", "?") + (f" {src['path']}" if src.get("path") else "")
    if src.get("limit") is not None:
        what += f", first {src['limit']}"
    if src.get("split") and src["split"] != "auto":
        what += f", split {src['split']}"
    return what


def headline_text(h: dict) -> str:
    if not h:
        return "no results yet"
    parts = [f"tau offline {_f(h.get('tau_offline'))}"]
    if "tau_live" in h:
        parts += [
            f"tau live {_f(h['tau_live'])} (setting {h['setting']}, offline at it "
            f"{_f(h.get('tau_offline_same_setting'))})",
            f"tok/s baseline {_f(h['baseline_tok_s'], '{:.1f}')} vs speculative {_f(h['speculative_tok_s'], '{:.1f}')} "
            f"(x{h['speedup']:.2f})",
            f"break-even tau {_f(h['break_even_tau'])}",
        ]
    return "; ".join(parts)


def divergence_text(d: dict | None) -> str | None:
    """The warning for a training whose loss rose DIVERGED x above its first logged loss (train/metrics.py)."""
    if d is None:
        return None
    return (
        f"warning: the training diverged: loss {d['loss']:.4g} at step {d['step']}, over {DIVERGED:.0f}x the first "
        f"logged loss {d['first_loss']:.4g} (step {d['first_step']}); its drafter is suspect: train again from a "
        "checkpoint before it with a lower train.lr"
    )


def _thin(rows: list[dict], keep: set[int], n: int = 12) -> list[dict]:
    """At most about n rows, evenly spaced, always with the indices in `keep`."""
    if len(rows) <= n:
        return rows
    stride = -(-len(rows) // n)
    return [r for i, r in enumerate(rows) if i % stride == 0 or i in keep]


def _md_train(r: dict) -> list[str]:
    t, held = r["train"]["last"], r["train"]["heldout"]
    L = ["## Training", ""]
    if not t and not held:
        return L + ["no train/metrics.jsonl", ""]
    if t:
        L += [
            f"{r['train']['steps']} logged steps; last step {t['step']}: loss {t['loss']:.3f}, depth-1 accuracy "
            f"{t['acc'][0]:.3f}.",
            "",
        ]
        if warning := divergence_text(r["train"].get("diverged")):
            L += [f"**{warning}**", ""]
        speed = r["train"].get("speed")
        if speed:
            line = (
                f"Speed (median of {speed['steps']} logged steps after the first): {speed['tokens_per_s']:,.0f} "
                f"tokens/s, {speed['s_per_step'] * 1e3:,.1f} ms per step."
            )
            if speed["phase_s"]:
                line = line[:-1] + ": " + ", ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in speed["phase_s"].items())
                line += (
                    ". `between` is the time from one step's end to the next batch on the device (loading, the "
                    "online target's prefill); when it is large, the GPU waits for data."
                )
            L += [line, ""]
        if "accept_len_est" in t:
            L += [
                f"Training-batch τ estimate (`accept_len_est`): {t['accept_len_est']:.2f} at step {t['step']}"
                + (
                    f", over the {t['tokens']:,} tokens of the batches since the previous log"
                    if t.get("tokens")
                    else ""
                )
                + ". It is measured on batches just trained on, teacher-forced: an optimistic in-sample figure, not "
                "the held-out τ below.",
                "",
            ]
    if held:
        best = max(range(len(held)), key=lambda i: held[i]["heldout_tau"])
        last = held[-1]
        toks = last.get("heldout_tokens")
        L += [
            f"Held-out τ while training (`heldout_tau`, chain greedy on {_f(toks, '{:,}')} held-out tokens): last "
            f"{last['heldout_tau']:.3f} at step "
            f"{last['step']}, best {held[best]['heldout_tau']:.3f} at step {held[best]['step']}.",
            "",
            "| step | held-out τ | training-batch estimate at that step |",
            "|---:|---:|---:|",
        ]
        est = r["train"].get("accept_len_est", {})
        for h in _thin(held, {best, len(held) - 1}):
            L.append(
                f"| {h['step']} | {h['heldout_tau']:.3f}{' (best)' if h is held[best] else ''} | "
                f"{_f(est.get(str(h['step'])))} |"
            )
        L.append("")
    else:
        L += ["No held-out τ was logged while training (no `heldout_tau` records in train/metrics.jsonl).", ""]
    for name, card in r["train"].get("exports", {}).items():
        tau = (
            f", held-out τ {card['heldout_tau']:.3f} at step {card.get('heldout_step')}"
            if "heldout_tau" in card
            else ""
        )
        role = {
            "last": "the last step, what SGLang is pointed at by default",
            "guarded": "the guard's choice, what SGLang is pointed at by default: "
            + (card.get("guard") or {}).get("why", ""),
        }.get(card.get("which"), "the best step by held-out τ")
        L += [f"- `{name}/`: {role}: step {card.get('step')}{tau}."]
    if r["train"].get("exports"):
        L.append("")
    return L + ["![training](train_loss.png)", ""]


def _md_offline(a: dict | None) -> list[str]:
    L = ["## Offline accept length (held-out features)", ""]
    if not a:
        return L + ["no eval/accept_len.json", ""]
    d = a.get("data") or {}
    srcs = "; ".join(_describe_source(s) for s in d.get("sources", [])) or "the held-out split"
    held_frac = d.get("heldout_fraction")
    auto = any(s.get("split") == "auto" for s in d.get("sources", []))
    held_out = f"; auto sources hold out {held_frac:.0%}" if held_frac is not None and auto else ""
    L += [
        f"Measured on: the held-out split of {d.get('features', 'RUN/features')} — {a['samples']} conversations "
        "(sources: "
        f"{srcs}{held_out}), "
        f"{a['roots']} roots (response tokens a draft chain starts from), drafter {a.get('checkpoint', '?')}"
        + (f" ({a['card'].get('which')} export, step {a['card'].get('step')})" if a.get("card") else "")
        + ".",
        "",
        f"**τ {a['headline_tau']:.3f}** ({a['headline']}) at {a['steps']}/{a['topk']}/{a['num_draft_tokens']}; chain "
        f"greedy {a['greedy']['tau']:.3f}, "
        f"chain sampled (T={a['sampled']['temperature']:g}, target top-k renormalised) {a['sampled']['tau']:.3f}"
        + (f"; tree greedy {a['tree']['tau']:.3f}" if a.get("tree") else "")
        + ". Per setting (a shorter chain is this chain cut): "
        + ", ".join(f"{k} {v['tau']:.3f}" for k, v in a.get("settings", {}).items())
        + ".",
        "",
        "Attempts at depth k are the chains whose drafts 1..k-1 were all accepted: a_k = accepted / attempts is "
        "conditional, "
        "and τ = 1 + Σ_k Π_{j≤k} a_j. The unconditional acc_k (every chain that reaches depth k in the data, accepted "
        "or not before) is a different number.",
        "",
        "| depth k | attempts | accepted | a_k greedy | a_k sampled | acc_k unconditional (not τ) | P(reach and "
        "accept) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g, s in zip(a["greedy"]["per_depth"], a["sampled"]["per_depth"]):
        L.append(
            f"| {g['depth']} | {g['attempts']:.0f} | {g['accepts']:.0f} | {g['a_k']:.3f} | {s['a_k']:.3f} | "
            f"{g['acc_k_unconditional']:.3f} | {g['reach_prob']:.3f} |"
        )
    return L + ["", "![acceptance](accept_per_depth.png)", ""]


def _md_bench(s: dict | None, e: dict | None, a: dict | None) -> list[str]:
    L = ["## Live benchmark", ""]
    if not s:
        return L + ["no bench/summary.json", ""]
    env = s["environment"]
    b = s["baseline"]["tok_s"]
    same = s.get("offline_same_prompts") or {}
    L += [
        f"Measured on: {s['prompts']['count']} prompts of bench.prompts "
        f"({_describe_source(s['prompts'].get('source'))}; the first user turn), "
        f"up to {s['max_new_tokens']} new tokens each, {s['repetitions']} interleaved repetitions (plain, then each "
        "setting, per repetition), "
        f"temperature {s['temperature']}; backend {s['backend']}; device {env.get('device')}; torch "
        f"{env.get('torch')}, "
        f"transformers {env.get('transformers')}, {env.get('torch_threads')} threads; load average at the end "
        f"{env.get('load_average')}.",
        "",
        f"Plain decoding: {b['median']:.1f} tok/s (min {b['min']:.1f}, max {b['max']:.1f}), "
        f"{s['baseline']['ms_per_token']:.2f} ms/token.",
        "",
        "| setting | tok/s median (min-max) | speed-up (paired) | τ live | verifies (tokens) | τ offline, same prompts: every "
        "root / cycle walk | τ offline, held-out (cycle walk) | break-even τ | max τ | verify ms | draft fwd ms | cycle ms | predicted tok/s "
        "(live τ) | outputs = plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ecs = {x["setting"]: x for x in e["settings"]}
    for row in s["speculative"]:
        x = ecs[row["key"]]
        tk = row["tok_s"]
        n_tok = row["tau"] * row["verify_count"] if row.get("tau") and row.get("verify_count") else None
        L.append(
            f"| {row['key']} | {tk['median']:.1f} ({tk['min']:.1f}-{tk['max']:.1f}) | {row['speedup_median']:.2f} "
            f"({_f((row.get('speedup_paired') or {}).get('median'))}) | "
            f"{_f(row['tau'])} | "
            f"{row.get('verify_count') or '—'} ({_f(n_tok, '{:.0f}')}) | "
            f"{_f(same.get('settings', {}).get(row['key']))} / {_f(same.get('settings_walk', {}).get(row['key']))} | "
            f"{_f(x['tau_offline'])} | "
            f"{x['break_even_tau']:.2f} | {x['max_tau']} | {_f(row['verify_ms'])} | {_f(row['draft_forward_ms'])} | "
            f"{_f(x['measured_cycle_ms'])} | "
            f"{_f(x['predicted_tok_s_live_tau'], '{:.1f}')} | {_f(row['outputs_match_baseline'])} |"
        )
    L.append("")
    if same:
        L += [
            f"τ offline, same prompts: the drafter scored offline on {same['source']} ({same['samples']} sequences, "
            f"{same['roots']} roots), "
            "the same tokens the live runs decoded. Every root: the mean over every answer token, as published tables "
            "count; cycle walk: cycles start where the last one ended, as a live decoder's do (eval/offline/acceptance.py), "
            "so it is the offline figure for τ live.",
            "",
        ]
    else:
        L += [
            "τ offline here is on the held-out features, other prompts than the benchmark's; this backend does not "
            "score the bench's own outputs offline.",
            "",
        ]
    return L


def _reach_cell(r: dict) -> str:
    if r["reachable"]:
        return f"{r['tau_needed']:.2f}"
    need = r.get("needed_setting")
    return f"{r['tau_needed']:.2f}: out of reach" + (
        f", needs {need}{'*' if r.get('extrapolated') else ''}" if need else ", no chain reaches it"
    )


def _md_economics(s: dict | None, e: dict | None, prediction: dict | None) -> list[str]:
    L = ["## Economics", ""]
    if not e:
        L += ["no bench/summary.json: no measured costs in this run.", ""]
        if prediction:
            L += _md_calibrated(prediction)
        return L
    L += [
        f"Cost model ({s['costs']['source']}): plain decoding {e['baseline_ms_per_token']:.2f} ms/token; verify ms by "
        "tokens "
        + ", ".join(f"{k}: {v:.2f}" for k, v in e["verify_ms"].items())
        + f"; draft forward {e['draft_forward_ms']:.2f} ms; cycle overhead {e['overhead_ms']:.2f} ms. cycle = steps × "
        "draft forward + verify(draft tokens) + overhead; "
        f"tok/s = τ / cycle. Best measured setting by predicted tok/s: {e['best_setting']} ({e['best_basis']} τ).",
        "",
    ]
    if e.get("reach"):
        goals = sorted({round(r["speedup"], 6) for r in e["reach"]})
        L += [
            "The τ each setting needs for a speed-up over plain decoding (a τ above the setting's maximum cannot "
            "happen there; "
            "* = the deeper setting's verify cost is extrapolated flat beyond the measured sizes):",
            "",
            "| setting | max τ | "
            + " | ".join(f"τ for x{g:.2f} ({g / e['baseline_ms_per_token'] * 1e3:.1f} tok/s)" for g in goals)
            + " |",
            "|---|---:|" + "---:|" * len(goals),
        ]
        for key in dict.fromkeys(r["setting"] for r in e["reach"]):
            cells = {round(r["speedup"], 6): r for r in e["reach"] if r["setting"] == key}
            L.append(
                f"| {key} | {next(iter(cells.values()))['max_tau']} | "
                + " | ".join(_reach_cell(cells[g]) if g in cells else "—" for g in goals)
                + " |"
            )
        L.append("")
    if e["offline_predictions"]:
        L += [
            "Offline τ priced with the measured costs (settings not benchmarked included):",
            "",
            "| setting | τ offline | cycle ms | break-even τ | predicted tok/s |",
            "|---|---:|---:|---:|---:|",
        ]
        L += [
            f"| {o['setting']} | {o['tau_offline']:.2f} | {o['cycle_ms']:.2f} | {o['break_even_tau']:.2f} | "
            f"{o['predicted_tok_s']:.1f} |"
            for o in e["offline_predictions"]
        ]
        L += [""]
    if e.get("calibrated"):
        L += _md_calibrated(e["calibrated"])
    return L + ["![tau](tau_offline_vs_live.png)", "", "![tok/s](tok_s_vs_draft_tokens.png)", ""]


def _range(iv: list[float] | None) -> str:
    return f" [{iv[0]:.1f}-{iv[1]:.1f}]" if iv else ""


def _md_calibrated(p: dict) -> list[str]:
    c = p["calibration"]
    L = [
        f"Predicted from offline τ alone with the costs calibrated in another run ({c['source_run']}: {c['backend']}, "
        f"{c['device']}; "
        f"{c['path']}): tok/s = τ offline / calibrated cycle"
        + (" (this prediction was written before this run's benchmark)" if p.get("made_before_bench") else "")
        + ".",
        "",
    ]
    L += [f"- warning: {w}" for w in p.get("warnings", [])] + ([""] if p.get("warnings") else [])
    L += [
        "| setting | τ offline | cycle ms (calibration) | predicted tok/s (speed-up) | measured tok/s (speed-up) | "
        "error | at this run's plain speed: predicted, error | from live τ: predicted, error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["rows"]:
        L.append(
            f"| {r['setting']} | {r['tau_offline']:.2f} | {r['cycle_ms']:.2f} ({r['cycle_basis']}) | "
            f"{r['predicted_tok_s']:.1f}{_range(r.get('predicted_tok_s_interval'))} (x{r['predicted_speedup']:.2f}) | "
            f"{_f(r.get('measured_tok_s'), '{:.1f}')} (x{_f(r.get('measured_speedup'))}) | "
            f"{_f(r.get('error_pct'), '{:+.1f}%')} | "
            f"{_f(r.get('predicted_tok_s_at_plain'), '{:.1f}')}, {_f(r.get('error_pct_at_plain'), '{:+.1f}%')} | "
            f"{_f(r.get('predicted_tok_s_live_tau'), '{:.1f}')}, {_f(r.get('error_pct_live_tau'), '{:+.1f}%')} |"
        )
    notes = []  # paragraphs under the table, each where the prediction has what it speaks of
    if any(r.get("predicted_tok_s_interval") for r in p["rows"]):
        notes.append(
            "In brackets: the tok/s of the offline τ's 90% interval over the prompts drawn again, as many: how far τ "
            "moves on another draw of prompts, a scale for a live bench whose answers part from the plain ones."
        )
    if b := p.get("baseline"):
        notes.append(
            f"Plain decoding ran {b['calibration_tok_s']:.1f} tok/s in the calibration and {b['measured_tok_s']:.1f} "
            f"here ({b['error_pct']:+.1f}%): the host's drift between the runs, in every setting's tok/s error. \"At "
            "this run's plain speed\" prices the predicted speed-up (the calibrated cycle in plain steps) at this "
            "run's plain tok/s, without that drift."
        )
    if k := p.get("pick"):
        notes.append(
            f"The economics picks **{k['setting']}** (the highest predicted speed-up among the settings the "
            f"calibration ran): x{k['predicted_speedup']:.2f}, breaking even at τ {k['break_even_tau']:.2f}"
            + (f"; measured x{k['measured_speedup']:.2f}." if k.get("measured_speedup") is not None else ".")
        )
    for note in notes:
        L += ["", note]
    return L + [""]


def markdown(r: dict) -> str:
    L = [f"# eagle3ft report: {r['run_dir']}", "", f"**Headline:** {headline_text(r['headline'])}", ""]
    if r.get("verdict"):
        L += [f"**Verdict:** {r['verdict']}", ""]
    L += [TERMS, ""]
    L += _md_train(r)
    L += _md_offline(r["accept_len"])
    L += _md_bench(r["bench"], r["economics"], r["accept_len"])
    L += _md_economics(r["bench"], r["economics"], r.get("prediction"))
    return "\n".join(L)
