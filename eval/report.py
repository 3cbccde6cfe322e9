"""Join a run's training log, offline accept length and live benchmark into one report.

    python eval/report.py --config CFG --run-dir RUN

Reads RUN/train/metrics.jsonl, RUN/eval/accept_len.json, RUN/bench/summary.json (each optional: a
missing part is reported as missing) and writes RUN/eval/report.json, RUN/eval/report.md and the
plots RUN/eval/{train_loss,accept_per_depth,tau_offline_vs_live,tok_s_vs_draft_tokens}.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from eagle3ft.eval.economics import Setting, analyse, offline_tau_by_setting  # noqa: E402


def _read_json(p: Path) -> dict | None:
    return json.loads(p.read_text()) if p.exists() else None


def read_metrics(p: Path) -> list[dict]:
    """Training records, the last one per step (a resumed run appends again from its checkpoint)."""
    if not p.exists():
        return []
    by_step = {}
    for line in p.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    return [by_step[k] for k in sorted(by_step)]


def _save(fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_train(metrics: list[dict], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
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
    return _save(fig, out)


def plot_accept(acc: dict, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    g, s = acc["greedy"]["per_depth"], acc["sampled"]["per_depth"]
    depths = [r["depth"] for r in g]
    w = 0.27
    ax.bar([d - w for d in depths], [r["a_k"] for r in g], w, label="a_k greedy (conditional)")
    ax.bar(depths, [r["a_k"] for r in s], w, label=f"a_k sampled T={acc['sampled']['temperature']:g} (conditional)")
    ax.bar([d + w for d in depths], [r["acc_k_unconditional"] for r in g], w, label="acc_k greedy (unconditional)", color="tab:gray")
    ax.plot(depths, [r["reach_prob"] for r in g], "k.-", label="P(depth accepted) greedy")
    ax.set_xticks(depths)
    ax.set_xlabel("draft depth k")
    ax.set_ylabel("rate")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax.set_title(f"Offline acceptance per depth, {acc['roots']} roots; tau greedy {acc['greedy']['tau']:.2f}")
    ax.grid(alpha=0.3, axis="y")
    return _save(fig, out)


def plot_tau(rows: list[dict], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    w = 0.38
    b1 = ax.bar([x - w / 2 for x in xs], [r["tau_offline"] or 0 for r in rows], w, label="offline (held-out features)")
    b2 = ax.bar([x + w / 2 for x in xs], [r["tau_live"] or 0 for r in rows], w, label="live (benchmark)")
    ax.bar_label(b1, fmt="%.2f", fontsize=8)
    ax.bar_label(b2, fmt="%.2f", fontsize=8)
    ax.plot(xs, [r["max_tau"] for r in rows], "k_", markersize=30, label="max (steps + 1)")
    ax.plot(xs, [r["break_even_tau"] for r in rows], "r_", markersize=30, label="break-even (live costs)")
    ax.set_ylim(0, 1.3 * max(max(r["max_tau"], r["break_even_tau"]) for r in rows))
    ax.set_xticks(list(xs), [r["setting"] for r in rows])
    ax.set_xlabel("setting steps/topk/draft tokens")
    ax.set_ylabel("accept length tau")
    ax.legend(fontsize=8, loc="upper left", ncol=2)
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
    ax.plot(n, [pred.get(Setting.of(r["setting"]).key) or float("nan") for r in spec], "x", color="tab:green", label="predicted from costs at live tau")
    ax.axhline(base["median"], color="tab:red", ls="--", label=f"baseline {base['median']:.1f} tok/s = break-even")
    ax.axhspan(base["min"], base["max"], color="tab:red", alpha=0.1)
    ax.set_xlabel("draft tokens per verify")
    ax.set_ylabel("decode tok/s")
    ax.set_xticks(sorted(set(n)))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(f"Live decode speed ({summary['backend']}, {summary['environment'].get('device', '')[:40]})", fontsize=9)
    be = [r["break_even_tau"] for r in econ["settings"]]
    ax2.plot(n, be, "r--o", label="break-even tau (cycle / baseline step)")
    ax2.plot(n, [r["tau_live"] or float("nan") for r in econ["settings"]], "o", label="live tau")
    ax2.plot(n, [r["tau_offline"] or float("nan") for r in econ["settings"]], "s", mfc="none", label="offline tau")
    ax2.plot(n, n, ":x", color="gray", label="max tau (= draft tokens)")
    ax2.set_xlabel("draft tokens per verify")
    ax2.set_ylabel("tau")
    ax2.set_xticks(sorted(set(n)))
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    ax2.set_title("Speculation pays where tau > break-even", fontsize=9)
    return _save(fig, out)


def _f(x, fmt="{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def build(run_dir: Path) -> dict:
    out = run_dir / "eval"
    out.mkdir(parents=True, exist_ok=True)
    metrics = read_metrics(run_dir / "train" / "metrics.jsonl")
    acc = _read_json(out / "accept_len.json")
    summary = _read_json(run_dir / "bench" / "summary.json")
    econ = analyse(summary, offline_tau_by_setting(out / "accept_len.json")).to_dict() if summary else None
    plots = {}
    if metrics:
        plots["train_loss"] = plot_train(metrics, out / "train_loss.png").name
    if acc:
        plots["accept_per_depth"] = plot_accept(acc, out / "accept_per_depth.png").name
    if econ and econ["settings"]:
        plots["tau_offline_vs_live"] = plot_tau(econ["settings"], out / "tau_offline_vs_live.png").name
        plots["tok_s_vs_draft_tokens"] = plot_tok_s(summary, econ, out / "tok_s_vs_draft_tokens.png").name
    headline = {}
    if acc:
        headline["tau_offline"] = acc["headline_tau"]
    if summary and summary["speculative"]:
        cfg_key = f"{acc['steps']}/{acc['topk']}/{acc['num_draft_tokens']}" if acc else None
        rows = {r["key"]: r for r in summary["speculative"]}
        best = rows.get(econ["best_setting"]) or summary["speculative"][0]
        head = rows.get(cfg_key) if cfg_key in rows else best
        headline.update(
            setting=head["key"],
            tau_live=head["tau"],
            tau_offline_same_setting=(acc or {}).get("settings", {}).get(head["key"], {}).get("tau"),
            baseline_tok_s=summary["baseline"]["tok_s_median"],
            speculative_tok_s=head["tok_s_median"],
            speedup=head["speedup_median"],
            break_even_tau=next(r["break_even_tau"] for r in econ["settings"] if r["setting"] == head["key"]),
        )
    report = {
        "run_dir": str(run_dir),
        "headline": headline,
        "train": {"steps": len(metrics), "last": metrics[-1] if metrics else None},
        "accept_len": acc,
        "bench": summary,
        "economics": econ,
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


def markdown(r: dict) -> str:
    L = [f"# eagle3ft report: {r['run_dir']}", "", f"**Headline:** {headline_text(r['headline'])}", ""]
    t = r["train"]["last"]
    L += ["## Training", ""]
    if t:
        L += [f"{r['train']['steps']} logged steps; last step {t['step']}: loss {t['loss']:.3f}, depth-1 accuracy {t['acc'][0]:.3f}"
              + (f", training-time accept-length estimate {t['accept_len_est']:.2f}" if "accept_len_est" in t else ""), "", "![training](train_loss.png)", ""]
    else:
        L += ["no train/metrics.jsonl", ""]
    a = r["accept_len"]
    L += ["## Offline accept length (held-out features)", ""]
    if a:
        L += [
            f"{a['samples']} samples, {a['roots']} roots, steps {a['steps']}, topk {a['topk']}, draft tokens {a['num_draft_tokens']}: "
            f"**tau {a['headline_tau']:.3f}** ({a['headline']}); chain greedy {a['greedy']['tau']:.3f}, "
            f"chain sampled (T={a['sampled']['temperature']:g}, target top-k renormalised) {a['sampled']['tau']:.3f}"
            + (f"; tree greedy {a['tree']['tau']:.3f}" if a.get("tree") else ""),
            "",
            "| depth | a_k greedy | a_k sampled | acc_k unconditional (not tau) | P(reach and accept) | chains |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for g, s in zip(a["greedy"]["per_depth"], a["sampled"]["per_depth"]):
            L.append(f"| {g['depth']} | {g['a_k']:.3f} | {s['a_k']:.3f} | {g['acc_k_unconditional']:.3f} | {g['reach_prob']:.3f} | {g['chains']} |")
        L += ["", "![acceptance](accept_per_depth.png)", ""]
    else:
        L += ["no eval/accept_len.json", ""]
    s, e = r["bench"], r["economics"]
    L += ["## Live benchmark", ""]
    if s:
        env = s["environment"]
        b = s["baseline"]["tok_s"]
        L += [
            f"backend {s['backend']}; {s['prompts']['count']} prompts, {s['max_new_tokens']} new tokens, {s['repetitions']} interleaved repetitions, "
            f"temperature {s['temperature']}; device {env.get('device')}; torch {env.get('torch')}, transformers {env.get('transformers')}, "
            f"{env.get('torch_threads')} threads; load average at the end {env.get('load_average')}",
            "",
            f"baseline: {b['median']:.1f} tok/s (min {b['min']:.1f}, max {b['max']:.1f}), {s['baseline']['ms_per_token']:.2f} ms/token",
            "",
            "| setting | tok/s median (min-max) | speedup | tau live | tau offline | break-even tau | verify ms | draft fwd ms | cycle ms | predicted tok/s (live tau) | outputs = baseline |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        ecs = {x["setting"]: x for x in e["settings"]}
        for row in s["speculative"]:
            x = ecs[row["key"]]
            tk = row["tok_s"]
            L.append(
                f"| {row['key']} | {tk['median']:.1f} ({tk['min']:.1f}-{tk['max']:.1f}) | {row['speedup_median']:.2f} | {_f(row['tau'])} | {_f(x['tau_offline'])} | "
                f"{x['break_even_tau']:.2f} | {_f(row['verify_ms'])} | {_f(row['draft_forward_ms'])} | {_f(x['measured_cycle_ms'])} | "
                f"{_f(x['predicted_tok_s_live_tau'], '{:.1f}')} | {_f(row['outputs_match_baseline'])} |"
            )
        L += [
            "",
            f"Cost model ({s['costs']['source']}): baseline {e['baseline_ms_per_token']:.2f} ms/token; verify ms by tokens "
            + ", ".join(f"{k}: {v:.2f}" for k, v in e["verify_ms"].items())
            + f"; draft forward {e['draft_forward_ms']:.2f} ms; cycle overhead {e['overhead_ms']:.2f} ms. "
            f"Best measured setting by predicted tok/s: {e['best_setting']} ({e['best_basis']} tau).",
            "",
        ]
        if e["offline_predictions"]:
            L += ["Offline tau priced with the measured costs (settings not benchmarked included):", "",
                  "| setting | tau offline | cycle ms | break-even tau | predicted tok/s |", "|---|---:|---:|---:|---:|"]
            L += [f"| {o['setting']} | {o['tau_offline']:.2f} | {o['cycle_ms']:.2f} | {o['break_even_tau']:.2f} | {o['predicted_tok_s']:.1f} |" for o in e["offline_predictions"]]
            L += [""]
        L += [
            "![tau](tau_offline_vs_live.png)",
            "",
            "![tok/s](tok_s_vs_draft_tokens.png)",
            "",
        ]
    else:
        L += ["no bench/summary.json", ""]
    return "\n".join(L)


def main(argv: list[str] | None = None) -> None:
    from eagle3ft.data.config import parse_cli
    from eagle3ft.eval.preflight import check_or_exit

    cfg, run_dir, args = parse_cli("Report: training, offline accept length, live benchmark.", stage="report", argv=argv)
    check_or_exit("report.py", "report", cfg, run_dir, args.config)
    rep = build(run_dir)
    print(f"report: {run_dir / 'eval' / 'report.md'}")
    print(headline_text(rep["headline"]))


if __name__ == "__main__":
    main()
