"""The report's plots (eval/report/build.py draws them into RUN/eval/): training loss and held-out tau, acceptance per
depth, offline against live tau per setting, and tok/s against the number of draft tokens.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from eagle3ft.setting import Setting  # noqa: E402


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
        ("offline, held-out features (cycle walk)", [r["tau_offline"] for r in rows]),
        ("live (benchmark)", [r["tau_live"] for r in rows]),
    ]
    if same_prompts:
        bars.insert(
            1, ("offline, the bench's own answers (cycle walk)", [same_prompts.get(r["setting"]) for r in rows])
        )
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
