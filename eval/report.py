"""Join a run's training log, offline accept length and live benchmark into one report.

    python eval/report.py --config CFG --run-dir RUN

Reads RUN/train/metrics.jsonl, RUN/eval/accept_len.json, RUN/bench/summary.json and
RUN/bench/prediction.json (each optional: a missing part is reported as missing; with none of the
first three the preflight stops) and writes RUN/eval/report.json, RUN/eval/report.md and the plots
RUN/eval/{train_loss,accept_per_depth,tau_offline_vs_live,tok_s_vs_draft_tokens}.png.

report.md, in order: the headline (the line `make demo` prints); a verdict sentence (tau against the
break-even at the headline setting, and how much faster or slower speculation ran); the terms (tau,
setting, draft tokens counting the root, break-even); Training (the training-batch tau estimate,
labelled as such, apart from held-out tau when train/metrics.jsonl has `heldout_tau` records);
Offline accept length (which prompts and how many roots; attempts, accepted and a_k per depth); Live
benchmark (which prompts, verifies and tokens behind each live tau, offline tau on the same prompts
where the backend scores them); Economics (costs, the tau each setting needs for x1.0/x1.5/x2.0 and
whether it is out of reach, offline tau priced, and the calibrated prediction against measured).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from eagle3ft.eval.calibration import join, load_calibration, predict  # noqa: E402
from eagle3ft.eval.costs import Setting  # noqa: E402
from eagle3ft.eval.economics import analyse, offline_tau_by_setting  # noqa: E402


def _read_json(p: Path) -> dict | None:
    return json.loads(p.read_text()) if p.exists() else None


def read_metrics(p: Path) -> tuple[list[dict], list[dict]]:
    """(training records, held-out records) from train/metrics.jsonl, the last one per step of each.

    A training record has "loss" (its accept_len_est is measured on the batches just trained on); a
    held-out record has "heldout_tau" (the drafter on held-out features). A resumed run appends again
    from its checkpoint, so a later record of a step replaces an earlier one.
    """
    if not p.exists():
        return [], []
    train, heldout = {}, {}
    for line in p.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if "loss" in rec:
                train[rec["step"]] = rec
            if "heldout_tau" in rec:
                heldout[rec["step"]] = rec
    return [train[k] for k in sorted(train)], [heldout[k] for k in sorted(heldout)]


def _save(fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_train(metrics: list[dict], heldout: list[dict], out: Path) -> Path:
    fig, (ax, axt) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [m["step"] for m in metrics]
    ax.plot(steps, [m["loss"] for m in metrics], label="TTT loss (decayed sum)", color="tab:blue")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if metrics and "acc" in metrics[0]:
        ax2 = ax.twinx()
        ax2.plot(steps, [m["acc"][0] for m in metrics], label="depth-1 accuracy", color="tab:orange", alpha=0.8)
        ax2.set_ylabel("depth-1 accuracy")
        ax2.set_ylim(0, 1)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="upper right")
    ax.set_title("Drafter training")
    est = [(m["step"], m["accept_len_est"]) for m in metrics if "accept_len_est" in m]
    if est:
        axt.plot(*zip(*est), color="tab:gray", label="training-batch estimate (batches just trained on)")
    if heldout:
        axt.plot(
            [h["step"] for h in heldout],
            [h["heldout_tau"] for h in heldout],
            "o-",
            color="tab:green",
            label="held-out tau (chain greedy)",
        )
    axt.set_xlabel("optimizer step")
    axt.set_ylabel("accept length tau")
    axt.grid(alpha=0.3)
    if est or heldout:
        axt.legend(fontsize=8)
    axt.set_title("tau while training: held out vs the training batches", fontsize=9)
    return _save(fig, out)


def plot_accept(acc: dict, out: Path) -> Path:
    """Attempts per depth as bars (the conditional denominators), a_k on a second axis."""
    fig, ax = plt.subplots(figsize=(7, 4))
    g, s = acc["greedy"]["per_depth"], acc["sampled"]["per_depth"]
    depths = [r["depth"] for r in g]
    bars = ax.bar(
        depths,
        [r["attempts"] for r in g],
        0.6,
        color="tab:blue",
        alpha=0.35,
        label="attempts (greedy): chains that reached depth k",
    )
    ax.bar_label(bars, labels=[f"{r['attempts']:.0f}" for r in g], fontsize=8)
    ax.set_xticks(depths)
    ax.set_xlabel("draft depth k")
    ax.set_ylabel("attempts")
    ax.set_ylim(0, 1.15 * max([r["attempts"] for r in g] + [1]))
    ax2 = ax.twinx()
    ax2.plot(depths, [r["a_k"] for r in g], "o-", color="tab:blue", label="a_k greedy = accepted / attempts")
    ax2.plot(
        depths,
        [r["a_k"] for r in s],
        "s--",
        color="tab:orange",
        label=f"a_k sampled T={acc['sampled']['temperature']:g}",
    )
    ax2.plot(
        depths, [r["acc_k_unconditional"] for r in g], "x:", color="tab:gray", label="acc_k unconditional (not tau)"
    )
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1.05)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper right")
    ax.set_title(
        f"Offline acceptance per depth, {acc['roots']} roots; tau greedy {acc['greedy']['tau']:.2f}", fontsize=10
    )
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out)


def plot_tau(rows: list[dict], out: Path, same_prompts: dict[str, float] | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    bars = [
        ("offline, held-out features", [r["tau_offline"] for r in rows]),
        ("live (benchmark)", [r["tau_live"] for r in rows]),
    ]
    if same_prompts:
        bars.insert(1, ("offline, the bench's own prompts", [same_prompts.get(r["setting"]) for r in rows]))
    w = 0.8 / len(bars)
    for i, (label, vals) in enumerate(bars):
        b = ax.bar([x + (i - (len(bars) - 1) / 2) * w for x in xs], [v or 0 for v in vals], w, label=label)
        ax.bar_label(b, labels=["-" if v is None else f"{v:.2f}" for v in vals], fontsize=7)
    ax.plot(xs, [r["max_tau"] for r in rows], "k_", markersize=30, label="max (steps + 1)")
    ax.plot(xs, [r["break_even_tau"] for r in rows], "r_", markersize=30, label="break-even (live costs)")
    ax.set_ylim(0, 1.3 * max(max(r["max_tau"], r["break_even_tau"]) for r in rows))
    ax.set_xticks(list(xs), [r["setting"] for r in rows])
    ax.set_xlabel("setting steps/topk/draft tokens")
    ax.set_ylabel("accept length tau")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    ax.set_title("Accept length: offline against live")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out)


def plot_tok_s(summary: dict, econ: dict, out: Path) -> Path:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    base = summary["baseline"]["tok_s"]
    spec = summary["speculative"]
    n = [r["setting"]["num_draft_tokens"] for r in spec]
    med = [r["tok_s"]["median"] for r in spec]
    err = [[m - r["tok_s"]["min"] for m, r in zip(med, spec)], [r["tok_s"]["max"] - m for m, r in zip(med, spec)]]
    ax.errorbar(n, med, yerr=err, fmt="o", capsize=4, label="speculative, measured (median, min-max)")
    pred = {r["setting"]: r["predicted_tok_s_live_tau"] for r in econ["settings"]}
    ax.plot(
        n,
        [pred.get(Setting.of(r["setting"]).key) or float("nan") for r in spec],
        "x",
        color="tab:green",
        label="predicted from costs at live tau",
    )
    cal = {r["setting"]: r["predicted_tok_s"] for r in (econ.get("calibrated") or {}).get("rows", [])}
    if cal:
        ax.plot(
            n,
            [cal.get(r["key"], float("nan")) for r in spec],
            "+",
            color="tab:purple",
            markersize=10,
            label="predicted from offline tau, calibrated costs",
        )
    ax.axhline(base["median"], color="tab:red", ls="--", label=f"baseline {base['median']:.1f} tok/s = break-even")
    ax.axhspan(base["min"], base["max"], color="tab:red", alpha=0.1)
    ax.set_xlabel("draft tokens per verify (root included)")
    ax.set_ylabel("decode tok/s")
    ax.set_xticks(sorted(set(n)))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(
        f"Live decode speed ({summary['backend']}, {summary['environment'].get('device', '')[:40]})", fontsize=9
    )
    be = [r["break_even_tau"] for r in econ["settings"]]
    ax2.plot(n, be, "r--o", label="break-even tau (cycle / baseline step)")
    ax2.plot(n, [r["tau_live"] or float("nan") for r in econ["settings"]], "o", label="live tau")
    ax2.plot(n, [r["tau_offline"] or float("nan") for r in econ["settings"]], "s", mfc="none", label="offline tau")
    ax2.plot(n, [r["max_tau"] for r in econ["settings"]], ":x", color="gray", label="max tau (steps + 1)")
    ax2.set_xlabel("draft tokens per verify (root included)")
    ax2.set_ylabel("tau")
    ax2.set_xticks(sorted(set(n)))
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    ax2.set_title("Speculation pays where tau > break-even", fontsize=9)
    return _save(fig, out)


def _f(x, fmt="{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


# --------------------------------------------------------------------------- the words


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


def verdict(h: dict) -> str | None:
    """One plain sentence: tau against the break-even at the headline setting, and what that did to the speed."""
    if "tau_live" not in h or h.get("tau_live") is None:
        return None
    tau, be, sp = h["tau_live"], h["break_even_tau"], h["speedup"]
    side = "below" if tau < be else "above"
    speed = f"{abs(1 - sp) * 100:.0f}% {'slower' if sp < 1 else 'faster'}"
    link = "so" if (tau < be) == (sp < 1) else "yet, measured,"
    out = (
        f"τ {tau:.2f} is {side} the break-even {be:.2f} at {h['setting']}, {link} speculation is {speed} than plain decoding "
        f"({h['speculative_tok_s']:.1f} against {h['baseline_tok_s']:.1f} tok/s)."
    )
    if h.get("max_tau") is not None and be > h["max_tau"]:
        out += f" No drafter can pay at {h['setting']}: its τ is at most {h['max_tau']}."
    return out


def prediction_verdict(p: dict) -> str | None:
    rows = [r for r in p.get("rows", []) if r.get("measured_tok_s") is None]
    if not rows:
        return None
    best = max(rows, key=lambda r: r["predicted_tok_s"])
    side = "below" if best["tau_offline"] < best["break_even_tau"] else "above"
    sp = best["predicted_speedup"]
    return (
        f"Predicted (no live benchmark yet): offline τ {best['tau_offline']:.2f} is {side} the break-even {best['break_even_tau']:.2f} "
        f"at {best['setting']} with the costs of {p['calibration']['source_run']}, so speculation would be "
        f"{abs(1 - sp) * 100:.0f}% {'slower' if sp < 1 else 'faster'} ({best['predicted_tok_s']:.1f} tok/s)."
    )


# --------------------------------------------------------------------------- build


def build(run_dir: Path, cfg=None) -> dict:
    """report.json, report.md and the plots of `run_dir`; `cfg` supplies bench.calibration when set."""
    from eagle3ft.config import resolve_path

    out = run_dir / "eval"
    out.mkdir(parents=True, exist_ok=True)
    metrics, heldout = read_metrics(run_dir / "train" / "metrics.jsonl")
    est = {
        str(m["step"]): m["accept_len_est"]
        for m in metrics
        if m["step"] in {h["step"] for h in heldout} and "accept_len_est" in m
    }
    exports = {name: card for name in ("export", "export-best") if (card := _read_json(run_dir / name / "card.json"))}
    acc = _read_json(out / "accept_len.json")
    if acc and acc.get("checkpoint"):
        acc = {**acc, "card": _read_json(Path(acc["checkpoint"]) / "card.json")}
    summary = _read_json(run_dir / "bench" / "summary.json")
    offline = offline_tau_by_setting(out / "accept_len.json")
    cal = load_calibration(resolve_path(cfg.bench.calibration)) if cfg is not None and cfg.bench.calibration else None
    prediction = _read_json(run_dir / "bench" / "prediction.json")
    econ = analyse(summary, offline, cal).to_dict() if summary else None
    if econ and not econ["calibrated"] and prediction:
        econ["calibrated"] = join(prediction, summary)
    if cal and offline and not summary:
        prediction = predict(cal, offline)
    plots = {}
    if metrics or heldout:
        plots["train_loss"] = plot_train(metrics, heldout, out / "train_loss.png").name
    if acc:
        plots["accept_per_depth"] = plot_accept(acc, out / "accept_per_depth.png").name
    same = (summary or {}).get("offline_same_prompts")
    if econ and econ["settings"]:
        plots["tau_offline_vs_live"] = plot_tau(
            econ["settings"], out / "tau_offline_vs_live.png", (same or {}).get("settings")
        ).name
        plots["tok_s_vs_draft_tokens"] = plot_tok_s(summary, econ, out / "tok_s_vs_draft_tokens.png").name
    headline = {}
    if acc:
        headline["tau_offline"] = acc["headline_tau"]
    if summary and summary["speculative"]:
        cfg_key = f"{acc['steps']}/{acc['topk']}/{acc['num_draft_tokens']}" if acc else None
        rows = {r["key"]: r for r in summary["speculative"]}
        best = rows.get(econ["best_setting"]) or summary["speculative"][0]
        head = rows.get(cfg_key) if cfg_key in rows else best
        ec_row = next(r for r in econ["settings"] if r["setting"] == head["key"])
        headline.update(
            setting=head["key"],
            tau_live=head["tau"],
            tau_offline_same_setting=(acc or {}).get("settings", {}).get(head["key"], {}).get("tau"),
            baseline_tok_s=summary["baseline"]["tok_s_median"],
            speculative_tok_s=head["tok_s_median"],
            speedup=head["speedup_median"],
            break_even_tau=ec_row["break_even_tau"],
            max_tau=ec_row["max_tau"],
        )
    report = {
        "run_dir": str(run_dir),
        "headline": headline,
        "verdict": verdict(headline) or (prediction_verdict(prediction) if prediction and not summary else None),
        "train": {
            "steps": len(metrics),
            "last": metrics[-1] if metrics else None,
            "heldout": heldout,
            "accept_len_est": est,
            "exports": exports,
        },
        "accept_len": acc,
        "bench": summary,
        "economics": econ,
        "prediction": prediction if not summary else None,
        "plots": plots,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    return report


def headline_text(h: dict) -> str:
    if not h:
        return "no results yet"
    parts = [f"tau offline {_f(h.get('tau_offline'))}"]
    if "tau_live" in h:
        parts += [
            f"tau live {_f(h['tau_live'])} (setting {h['setting']}, offline at it {_f(h.get('tau_offline_same_setting'))})",
            f"tok/s baseline {_f(h['baseline_tok_s'], '{:.1f}')} vs speculative {_f(h['speculative_tok_s'], '{:.1f}')} (x{h['speedup']:.2f})",
            f"break-even tau {_f(h['break_even_tau'])}",
        ]
    return "; ".join(parts)


# --------------------------------------------------------------------------- markdown


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
            f"{r['train']['steps']} logged steps; last step {t['step']}: loss {t['loss']:.3f}, depth-1 accuracy {t['acc'][0]:.3f}.",
            "",
        ]
        if "accept_len_est" in t:
            L += [
                f"Training-batch τ estimate (`accept_len_est`): {t['accept_len_est']:.2f} at step {t['step']}"
                + (
                    f", over the {t['tokens']:,} tokens of the batches since the previous log"
                    if t.get("tokens")
                    else ""
                )
                + ". It is measured on batches just trained on, teacher-forced: an optimistic in-sample figure, not the held-out τ below.",
                "",
            ]
    if held:
        best = max(range(len(held)), key=lambda i: held[i]["heldout_tau"])
        last = held[-1]
        toks = last.get("heldout_tokens")
        L += [
            f"Held-out τ while training (`heldout_tau`, chain greedy on {_f(toks, '{:,}')} held-out tokens): last {last['heldout_tau']:.3f} at step "
            f"{last['step']}, best {held[best]['heldout_tau']:.3f} at step {held[best]['step']}.",
            "",
            "| step | held-out τ | training-batch estimate at that step |",
            "|---:|---:|---:|",
        ]
        est = r["train"].get("accept_len_est", {})
        for h in _thin(held, {best, len(held) - 1}):
            L.append(
                f"| {h['step']} | {h['heldout_tau']:.3f}{' (best)' if h is held[best] else ''} | {_f(est.get(str(h['step'])))} |"
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
        role = (
            "the last step, what SGLang is pointed at by default"
            if card.get("which") == "last"
            else "the best step by held-out τ"
        )
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
    L += [
        f"Measured on: the held-out split of {d.get('features', 'RUN/features')} — {a['samples']} conversations "
        f"(sources: {srcs}{f'; auto sources hold out {held_frac:.0%}' if held_frac is not None and any(s.get('split') == 'auto' for s in d.get('sources', [])) else ''}), "
        f"{a['roots']} roots (response tokens a draft chain starts from), drafter {a.get('checkpoint', '?')}"
        + (f" ({a['card'].get('which')} export, step {a['card'].get('step')})" if a.get("card") else "")
        + ".",
        "",
        f"**τ {a['headline_tau']:.3f}** ({a['headline']}) at {a['steps']}/{a['topk']}/{a['num_draft_tokens']}; chain greedy {a['greedy']['tau']:.3f}, "
        f"chain sampled (T={a['sampled']['temperature']:g}, target top-k renormalised) {a['sampled']['tau']:.3f}"
        + (f"; tree greedy {a['tree']['tau']:.3f}" if a.get("tree") else "")
        + ". Per setting (a shorter chain is this chain cut): "
        + ", ".join(f"{k} {v['tau']:.3f}" for k, v in a.get("settings", {}).items())
        + ".",
        "",
        "Attempts at depth k are the chains whose drafts 1..k-1 were all accepted: a_k = accepted / attempts is conditional, "
        "and τ = 1 + Σ_k Π_{j≤k} a_j. The unconditional acc_k (every chain that reaches depth k in the data, accepted or not before) is a different number.",
        "",
        "| depth k | attempts | accepted | a_k greedy | a_k sampled | acc_k unconditional (not τ) | P(reach and accept) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for g, s in zip(a["greedy"]["per_depth"], a["sampled"]["per_depth"]):
        L.append(
            f"| {g['depth']} | {g['attempts']:.0f} | {g['accepts']:.0f} | {g['a_k']:.3f} | {s['a_k']:.3f} | {g['acc_k_unconditional']:.3f} | {g['reach_prob']:.3f} |"
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
        f"Measured on: {s['prompts']['count']} prompts of bench.prompts ({_describe_source(s['prompts'].get('source'))}; the first user turn), "
        f"up to {s['max_new_tokens']} new tokens each, {s['repetitions']} interleaved repetitions (plain, then each setting, per repetition), "
        f"temperature {s['temperature']}; backend {s['backend']}; device {env.get('device')}; torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}, {env.get('torch_threads')} threads; load average at the end {env.get('load_average')}.",
        "",
        f"Plain decoding: {b['median']:.1f} tok/s (min {b['min']:.1f}, max {b['max']:.1f}), {s['baseline']['ms_per_token']:.2f} ms/token.",
        "",
        "| setting | tok/s median (min-max) | speed-up | τ live | verifies (tokens) | τ offline, same prompts | τ offline, held-out | break-even τ | max τ | verify ms | draft fwd ms | cycle ms | predicted tok/s (live τ) | outputs = plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ecs = {x["setting"]: x for x in e["settings"]}
    for row in s["speculative"]:
        x = ecs[row["key"]]
        tk = row["tok_s"]
        n_tok = row["tau"] * row["verify_count"] if row.get("tau") and row.get("verify_count") else None
        L.append(
            f"| {row['key']} | {tk['median']:.1f} ({tk['min']:.1f}-{tk['max']:.1f}) | {row['speedup_median']:.2f} | {_f(row['tau'])} | "
            f"{row.get('verify_count') or '—'} ({_f(n_tok, '{:.0f}')}) | {_f(same.get('settings', {}).get(row['key']))} | {_f(x['tau_offline'])} | "
            f"{x['break_even_tau']:.2f} | {x['max_tau']} | {_f(row['verify_ms'])} | {_f(row['draft_forward_ms'])} | {_f(x['measured_cycle_ms'])} | "
            f"{_f(x['predicted_tok_s_live_tau'], '{:.1f}')} | {_f(row['outputs_match_baseline'])} |"
        )
    L.append("")
    if same:
        L += [
            f"τ offline, same prompts: the drafter scored offline on {same['source']} ({same['samples']} sequences, {same['roots']} roots), "
            "the same tokens the live runs decoded: the two τ differ only by which roots a cycle starts from.",
            "",
        ]
    else:
        L += [
            "τ offline here is on the held-out features, other prompts than the benchmark's; this backend does not score the bench's own outputs offline.",
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
        f"Cost model ({s['costs']['source']}): plain decoding {e['baseline_ms_per_token']:.2f} ms/token; verify ms by tokens "
        + ", ".join(f"{k}: {v:.2f}" for k, v in e["verify_ms"].items())
        + f"; draft forward {e['draft_forward_ms']:.2f} ms; cycle overhead {e['overhead_ms']:.2f} ms. cycle = steps × draft forward + verify(draft tokens) + overhead; "
        f"tok/s = τ / cycle. Best measured setting by predicted tok/s: {e['best_setting']} ({e['best_basis']} τ).",
        "",
    ]
    if e.get("reach"):
        goals = sorted({round(r["speedup"], 6) for r in e["reach"]})
        L += [
            "The τ each setting needs for a speed-up over plain decoding (a τ above the setting's maximum cannot happen there; "
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
        L += ["Offline τ priced with the measured costs (settings not benchmarked included):", "",
              "| setting | τ offline | cycle ms | break-even τ | predicted tok/s |", "|---|---:|---:|---:|---:|"]  # fmt: skip
        L += [
            f"| {o['setting']} | {o['tau_offline']:.2f} | {o['cycle_ms']:.2f} | {o['break_even_tau']:.2f} | {o['predicted_tok_s']:.1f} |"
            for o in e["offline_predictions"]
        ]
        L += [""]
    if e.get("calibrated"):
        L += _md_calibrated(e["calibrated"])
    return L + ["![tau](tau_offline_vs_live.png)", "", "![tok/s](tok_s_vs_draft_tokens.png)", ""]


def _md_calibrated(p: dict) -> list[str]:
    c = p["calibration"]
    L = [
        f"Predicted from offline τ alone with the costs calibrated in another run ({c['source_run']}: {c['backend']}, {c['device']}; "
        f"{c['path']}): tok/s = τ offline / calibrated cycle"
        + (" (this prediction was written before this run's benchmark)" if p.get("made_before_bench") else "")
        + ".",
        "",
    ]
    L += [f"- warning: {w}" for w in p.get("warnings", [])] + ([""] if p.get("warnings") else [])
    L += [
        "| setting | τ offline | cycle ms (calibration) | predicted tok/s (speed-up) | measured tok/s (speed-up) | error | from live τ: predicted, error |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["rows"]:
        L.append(
            f"| {r['setting']} | {r['tau_offline']:.2f} | {r['cycle_ms']:.2f} ({r['cycle_basis']}) | {r['predicted_tok_s']:.1f} (x{r['predicted_speedup']:.2f}) | "
            f"{_f(r.get('measured_tok_s'), '{:.1f}')} (x{_f(r.get('measured_speedup'))}) | {_f(r.get('error_pct'), '{:+.1f}%')} | "
            f"{_f(r.get('predicted_tok_s_live_tau'), '{:.1f}')}, {_f(r.get('error_pct_live_tau'), '{:+.1f}%')} |"
        )
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


def main(argv: list[str] | None = None) -> None:
    from eagle3ft.cli import parse_cli
    from eagle3ft.eval.preflight import check_or_exit

    cfg, run_dir, args = parse_cli(
        "Report: training, offline accept length, live benchmark.", stage="report", argv=argv
    )
    check_or_exit("report.py", "report", cfg, run_dir, args.config)
    from eagle3ft.runlock import holding

    with holding(run_dir, "report", "report.py"):
        rep = build(run_dir, cfg)
    print(f"report: {run_dir / 'eval' / 'report.md'}")
    print(headline_text(rep["headline"]))
    if rep["verdict"]:
        print(rep["verdict"])


if __name__ == "__main__":
    main()
