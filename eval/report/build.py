"""Join a run's training log, offline accept length and live benchmark into one report.

    python eval/report/build.py --config CFG --run-dir RUN

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
The plots are drawn by eval/report/plots.py, report.md written by eval/report/md.py.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from eagle3ft.cli import cli_errors, command_name, error_log, parse_cli
from eagle3ft.config import BenchConfig, EvalConfig
from eagle3ft.drafter.folder import DrafterFolder
from eagle3ft.eval.economics.analysis import analyse, read_offline_tau
from eagle3ft.eval.economics.calibration import from_config, join, predict
from eagle3ft.eval.preflight import check_or_exit
from eagle3ft.eval.report.md import divergence_text, headline_text, markdown
from eagle3ft.eval.report.plots import plot_accept, plot_tau, plot_tok_s, plot_train
from eagle3ft.files import DamagedFile, read_json, write_atomic, write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.runlock import holding
from eagle3ft.setting import Setting
from eagle3ft.train.metrics import divergence


def _read_json(p: Path) -> dict | None:
    """The JSON object in `p` (None when absent); DamagedFile naming it when truncated or not an object."""
    if not p.exists():
        return None
    data = read_json(p, "an earlier stage's result")
    if not isinstance(data, dict):
        raise DamagedFile(f"{p}: not a JSON object; rerun the stage that writes it")
    return data


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


# --------------------------------------------------------------------------- verdicts


def verdict(h: dict) -> str | None:
    """One plain sentence: tau against the break-even at the headline setting, and what that did to the speed."""
    if "tau_live" not in h or h.get("tau_live") is None:
        return None
    tau, be, sp = h["tau_live"], h["break_even_tau"], h["speedup"]
    side = "below" if tau < be else "above"
    speed = f"{abs(1 - sp) * 100:.0f}% {'slower' if sp < 1 else 'faster'}"
    link = "so" if (tau < be) == (sp < 1) else "yet, measured,"
    out = (
        f"τ {tau:.2f} is {side} the break-even {be:.2f} at {h['setting']}, {link} speculation is {speed} than plain "
        "decoding "
        f"({h['speculative_tok_s']:.1f} against {h['baseline_tok_s']:.1f} tok/s)."
    )
    if h.get("speedup_e2e") is not None:
        sp_e2e = h["speedup_e2e"]
        out += (
            f" End to end, the prefill included, it is {abs(1 - sp_e2e) * 100:.0f}% "
            f"{'slower' if sp_e2e < 1 else 'faster'} ({h['e2e_tok_s']:.1f} against {h['baseline_e2e_tok_s']:.1f} tok/s)."
        )
    if h.get("tau_loop_free") is not None:
        lf = h["tau_loop_free"]
        out += (
            f" Outside repetition loops τ is {lf:.2f}, {'below' if lf < be else 'above'} the break-even: on traffic "
            f"that does not loop speculation {'would not pay' if lf < be else 'still pays'} at {h['setting']}."
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
        f"Predicted (no live benchmark yet): offline τ {best['tau_offline']:.2f} is {side} the break-even "
        f"{best['break_even_tau']:.2f} "
        f"at {best['setting']} with the costs of {p['calibration']['source_run']}, so speculation would be "
        f"{abs(1 - sp) * 100:.0f}% {'slower' if sp < 1 else 'faster'} ({best['predicted_tok_s']:.1f} tok/s)."
    )


# --------------------------------------------------------------------------- build


def step_time(metrics: list[dict]) -> dict | None:
    """Medians over the logged steps after the first (its warm-up): tokens/s, seconds per step, and the seconds of
    each phase of `phase_s` (train/metrics.py) where the records have them; None without timed records."""
    rows = [m for m in metrics if "tokens_per_s" in m][1:]
    if not rows:
        return None
    phased = [m["phase_s"] for m in rows if m.get("phase_s")]
    return {
        "steps": len(rows),
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in rows),
        "s_per_step": statistics.median(m["s_per_step"] for m in rows),
        "phase_s": {k: statistics.median(ph[k] for ph in phased) for k in phased[0]} if phased else None,
    }


def check_drafters(run_dir: Path, ev: EvalConfig | None, acc: dict | None) -> None:
    """NonFinite (one line, nothing written) when a drafter the report speaks for holds a NaN or inf weight:
    eval.checkpoint, and the drafter eval/accept_len.json was measured on."""

    folders = {"eval.checkpoint": RunDir(run_dir).drafter(ev.checkpoint)} if ev is not None else {}
    if acc and acc.get("checkpoint"):
        folders["eval/accept_len.json's checkpoint"] = Path(acc["checkpoint"])
    for where, folder in folders.items():
        if (folder / "config.json").is_file():
            DrafterFolder(folder, where).check_finite()


def build(run_dir: Path, ev: EvalConfig | None = None, bench: BenchConfig | None = None) -> dict:
    """report.json, report.md and the plots of `run_dir`; `ev` names the drafter checked, `bench` supplies
    bench.calibration when set."""
    run = RunDir(run_dir)
    acc = _read_json(run.accept_len)
    check_drafters(run_dir, ev, acc)
    out = run.eval
    out.mkdir(parents=True, exist_ok=True)
    metrics, heldout = read_metrics(run.metrics)
    est = {
        str(m["step"]): m["accept_len_est"]
        for m in metrics
        if m["step"] in {h["step"] for h in heldout} and "accept_len_est" in m
    }
    exports = {p.name: card for p in (run.export, run.export_best) if (card := _read_json(p / "card.json"))}
    if acc and acc.get("checkpoint"):
        acc = {**acc, "card": _read_json(Path(acc["checkpoint"]) / "card.json")}
    summary = _read_json(run.bench_summary)
    offline, basis, intervals = read_offline_tau(run.accept_len)
    cal = from_config(bench)
    prediction = _read_json(run.prediction)
    econ = analyse(summary, offline, cal, tau_basis=basis, intervals=intervals).to_dict() if summary else None
    if econ and not econ["calibrated"] and prediction:
        econ["calibrated"] = join(prediction, summary)
    if cal and offline and not summary:
        prediction = predict(cal, offline, basis, intervals)
    plots = {}
    if metrics or heldout:
        plots["train_loss"] = plot_train(metrics, heldout, out / "train_loss.png").name
    if acc:
        plots["accept_per_depth"] = plot_accept(acc, out / "accept_per_depth.png").name
    same = (summary or {}).get("offline_same_prompts")
    if econ and econ["settings"]:
        plots["tau_offline_vs_live"] = plot_tau(
            econ["settings"],
            out / "tau_offline_vs_live.png",
            (same or {}).get("settings_walk") or (same or {}).get("settings"),
        ).name
        plots["tok_s_vs_draft_tokens"] = plot_tok_s(summary, econ, out / "tok_s_vs_draft_tokens.png").name
    headline = {}
    if acc:
        headline["tau_offline"] = acc["headline_tau"]
    if summary and summary["speculative"]:
        cfg_key = Setting.of(acc).key if acc else None
        rows = {r["key"]: r for r in summary["speculative"]}
        best = rows.get(econ["best_setting"]) or summary["speculative"][0]
        head = rows.get(cfg_key) if cfg_key in rows else best
        ec_row = next(r for r in econ["settings"] if r["setting"] == head["key"])
        e2e = (head.get("figures") or {}).get("e2e") or {}
        base_e2e = (summary["baseline"].get("figures") or {}).get("e2e") or {}
        headline.update(
            setting=head["key"],
            tau_live=head["tau"],
            tau_loop_free=ec_row.get("tau_loop_free"),
            speedup_e2e=e2e.get("speedup_median"),
            e2e_tok_s=(e2e.get("tok_s") or {}).get("median"),
            baseline_e2e_tok_s=(base_e2e.get("tok_s") or {}).get("median"),
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
            "speed": step_time(metrics),
            "diverged": divergence(metrics),  # the first record whose loss rose DIVERGED x above the first's
        },
        "accept_len": acc,
        "bench": summary,
        "economics": econ,
        "prediction": prediction if not summary else None,
        "plots": plots,
    }
    write_json(out / "report.json", report, indent=2)
    write_atomic(run.report_md, markdown(report))
    return report


def main(argv: list[str] | None = None) -> None:
    prog = command_name("build.py")  # in errors: the command the user typed

    cfg, run_dir, args = parse_cli(
        "Report: training, offline accept length, live benchmark.", stage="report", argv=argv
    )
    check_or_exit(prog, "report", cfg, run_dir, args.config)

    with holding(run_dir, "report", prog), cli_errors(prog, log=error_log(run_dir, "report")):
        rep = build(run_dir, cfg.eval, cfg.bench)
    print(f"report: {RunDir(run_dir).report_md}")
    print(headline_text(rep["headline"]))
    if warning := divergence_text(rep["train"]["diverged"]):
        print(warning)
    if rep["verdict"]:
        print(rep["verdict"])


if __name__ == "__main__":
    main()
