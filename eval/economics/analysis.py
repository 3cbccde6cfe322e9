"""Speculation economics of one benchmark run: predicted against measured tok/s per setting, the best setting,
the tau each setting needs for a goal, and the prediction from another run's calibration. The cost model is
eval/economics/cost_model.py, the calibration eval/economics/calibration.py.

`python eval/economics/analysis.py --config CFG --run-dir RUN [--tok-s R]` reads RUN/bench/summary.json (and the
offline RUN/eval/accept_len.json when present), prints predicted against measured tok/s per setting
and writes RUN/bench/economics.json and RUN/bench/calibration.json; with bench.calibration and no
summary yet it prints and writes the prediction alone. --tok-s R: the tau each setting needs for R.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from eagle3ft.cli import build_parser, cli_errors, command_name, error_log, parse_cli
from eagle3ft.config import BenchConfig, TargetConfig
from eagle3ft.eval.economics.calibration import (
    CalibrationError,
    format_prediction,
    from_config,
    join,
    predict,
    write_calibration,
    write_prediction,
)
from eagle3ft.eval.economics.cost_model import GOAL_SPEEDUPS, cost_model_from_summary, fmt, reach, reach_text
from eagle3ft.eval.preflight import check_or_exit
from eagle3ft.files import DamagedFile, read_json, write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.runlock import holding
from eagle3ft.setting import Setting


@dataclass
class SettingEconomics:
    setting: str
    cycle_ms: float
    break_even_tau: float
    max_tau: int  # steps + 1: every draft accepted plus the bonus
    tau_live: float | None = None
    tau_offline: float | None = None
    predicted_tok_s_live_tau: float | None = None
    predicted_tok_s_offline_tau: float | None = None
    # on the tokens outside repetition loops (data/loops.py): the live split where the bench has one (streamed or
    # embedded spans; else over the answers with no loop), else the offline walk's; what the pick is made on
    tau_loop_free: float | None = None
    predicted_tok_s_loop_free_tau: float | None = None
    measured_tok_s: float | None = None
    measured_cycle_ms: float | None = None


@dataclass
class Economics:
    baseline_tok_s: float
    baseline_ms_per_token: float
    verify_ms: dict[int, float]
    draft_forward_ms: float
    overhead_ms: float
    settings: list[SettingEconomics] = field(default_factory=list)
    best_setting: str | None = None
    best_basis: str | None = None  # which tau chose the best setting: loop_free, then live, then offline
    tau_basis: str = "cycle walk"  # what the offline tau is: "cycle walk" (as a live decoder) or "every root"
    # every setting with an offline tau (benchmarked or not), priced with the measured costs
    offline_predictions: list[dict] = field(default_factory=list)
    reach: list[dict] = field(
        default_factory=list
    )  # the tau each benchmarked setting needs for GOAL_SPEEDUPS (and --tok-s)
    calibrated: dict | None = None  # this run's offline tau priced with another run's costs, against what it measured

    def to_dict(self) -> dict:
        return asdict(self)


def analyse(
    summary: dict,
    offline_tau: dict[str, float] | None = None,
    calibration: dict | None = None,
    tok_s: float | None = None,
    target: str | None = None,
    tau_basis: str = "cycle walk",
    intervals: dict | None = None,
    offline_loop_free: dict[str, float] | None = None,
) -> Economics:
    """Predicted against measured for every benchmarked setting, and the best of them.

    `offline_tau` maps a setting key ("steps/topk/draft_tokens") to the offline accept length (`tau_basis`: "cycle
    walk", what a live decoder sees, or "every root");
    `calibration` is another run's calibration.json (load_calibration, or from_config with its pool); `tok_s` a
    throughput to price; `target` this run's target name, checked against the calibration's; `intervals` the offline
    tau's 90% interval per setting (read_offline_tau), priced with the calibration; `offline_loop_free` the offline
    walk's tau on loop-free tokens, for settings whose live bench has no loop split. The best setting is picked on
    the loop-free tau where there is one: a user's traffic does not loop the way a small target does at T=0.
    """
    cm = cost_model_from_summary(summary)
    offline_tau = offline_tau or {}
    rows = []
    for s in summary["speculative"]:
        st = Setting.of(s["setting"])
        tau_live = s.get("tau")
        tau_off = offline_tau.get(st.key)
        tau_lf = loop_free_tau(s) or (offline_loop_free or {}).get(st.key)
        rows.append(
            SettingEconomics(
                setting=st.key,
                cycle_ms=1e3 * cm.cycle_s(st),
                break_even_tau=cm.break_even_tau(st),
                max_tau=st.steps + 1,
                tau_live=tau_live,
                tau_offline=tau_off,
                predicted_tok_s_live_tau=cm.tok_per_s(tau_live, st) if tau_live else None,
                predicted_tok_s_offline_tau=cm.tok_per_s(tau_off, st) if tau_off else None,
                tau_loop_free=tau_lf,
                predicted_tok_s_loop_free_tau=cm.tok_per_s(tau_lf, st) if tau_lf else None,
                measured_tok_s=s.get("tok_s_median"),
                measured_cycle_ms=1e3 * s["cycle_s"] if s.get("cycle_s") else None,
            )
        )
    best, basis = None, None
    for b in ("loop_free", "live", "offline"):
        scored = [
            (getattr(r, f"predicted_tok_s_{b}_tau"), r.setting) for r in rows if getattr(r, f"predicted_tok_s_{b}_tau")
        ]
        if scored:
            best, basis = max(scored)[1], b
            break
    offline_rows = []
    for key, tau in sorted(offline_tau.items()):
        st = Setting.parse(key)
        offline_rows.append(
            {
                "setting": key,
                "tau_offline": tau,
                "cycle_ms": 1e3 * cm.cycle_s(st),
                "break_even_tau": cm.break_even_tau(st),
                "predicted_tok_s": cm.tok_per_s(tau, st),
            }
        )
    goals = [g * cm.baseline_tok_s for g in GOAL_SPEEDUPS] + ([tok_s] if tok_s else [])
    reach_rows = [reach(cm, r, Setting.of(s["setting"])) for r in goals for s in summary["speculative"]]
    calibrated = join(predict(calibration, offline_tau, tau_basis, intervals), summary, target) if calibration else None
    return Economics(
        reach=reach_rows,
        calibrated=calibrated,
        offline_predictions=offline_rows,
        baseline_tok_s=cm.baseline_tok_s,
        baseline_ms_per_token=1e3 * cm.baseline_s_per_token,
        verify_ms={k: 1e3 * v for k, v in sorted(cm.verify_s.items())},
        draft_forward_ms=1e3 * cm.draft_forward_s,
        overhead_ms=1e3 * cm.overhead_s,
        settings=rows,
        best_setting=best,
        best_basis=basis,
        tau_basis=tau_basis,
    )


def loop_free_tau(row: dict) -> float | None:
    """A summary row's live tau outside loops: on loop-free tokens, else over the answers with no loop."""
    f = row.get("figures") or {}
    return (f.get("loop_free") or {}).get("tau") or (f.get("loop_free_answers") or {}).get("tau")


def format_table(ec: Economics) -> str:
    lines = [
        f"baseline {ec.baseline_tok_s:.1f} tok/s ({ec.baseline_ms_per_token:.2f} ms/token); "
        f"draft forward {ec.draft_forward_ms:.2f} ms; cycle overhead {ec.overhead_ms:.2f} ms",
        "verify ms by tokens: " + ", ".join(f"{k}: {v:.2f}" for k, v in ec.verify_ms.items()),
        *([f"tau off: offline, {ec.tau_basis}"] if any(r.tau_offline for r in ec.settings) else []),
        f"{'setting':>9} {'cycle ms':>9} {'meas. cyc':>9} {'break-even':>10} {'tau live':>8} {'tau off':>8} "
        f"{'tau lf':>7} {'pred(live)':>10} {'pred(off)':>10} {'pred(lf)':>9} {'measured':>9}",
    ]
    for r in ec.settings:
        lines.append(
            f"{r.setting:>9} {r.cycle_ms:>9.2f} {fmt(r.measured_cycle_ms):>9} {r.break_even_tau:>10.2f} "
            f"{fmt(r.tau_live):>8} "
            f"{fmt(r.tau_offline):>8} {fmt(r.tau_loop_free):>7} {fmt(r.predicted_tok_s_live_tau, '{:.1f}'):>10} "
            f"{fmt(r.predicted_tok_s_offline_tau, '{:.1f}'):>10} {fmt(r.predicted_tok_s_loop_free_tau, '{:.1f}'):>9} "
            f"{fmt(r.measured_tok_s, '{:.1f}'):>9}"
        )
    if ec.best_setting:
        lines.append(
            f"best measured setting by predicted tok/s ({ec.best_basis.replace('_', '-')} tau): {ec.best_setting}"
        )
    if ec.offline_predictions:
        best = max(ec.offline_predictions, key=lambda r: r["predicted_tok_s"])
        lines.append(
            "offline tau priced with these costs: "
            + ", ".join(f"{r['setting']} {r['predicted_tok_s']:.1f}" for r in ec.offline_predictions)
            + f" tok/s (best {best['setting']})"
        )
    lines += [reach_text(r) for r in ec.reach if not r["reachable"] or r["speedup"] == 1.0]
    if ec.calibrated:
        lines.append(format_prediction(ec.calibrated))
    return "\n".join(lines)


def offline_tau_by_setting(accept_len_json: Path) -> dict[str, float]:
    """Offline tau per setting as a live greedy decoder sees it: the cycle walk's where accept_len.json has one,
    else the mean over every root (a sampled evaluation, or a file from before the walk)."""
    return read_offline_tau(accept_len_json)[0]


def read_offline_tau(accept_len_json: Path) -> tuple[dict[str, float], str, dict[str, list[float]]]:
    """offline_tau_by_setting, what it is ("cycle walk" when every setting has the walk, else "every root"), and with
    the walk each setting's 90% interval over the prompts drawn again (accept_len.walk_interval), where it has one."""
    if not accept_len_json.exists():
        return {}, "every root", {}
    settings = json.loads(accept_len_json.read_text()).get("settings", {})
    if settings and all(v.get("tau_walk") for v in settings.values()):
        intervals = {k: v["tau_walk_interval"] for k, v in settings.items() if v.get("tau_walk_interval")}
        return {k: v["tau_walk"] for k, v in settings.items()}, "cycle walk", intervals
    return {k: v["tau"] for k, v in settings.items()}, "every root", {}


def offline_loop_free(run_dir: Path) -> dict[str, float]:
    """The offline walk's tau on loop-free tokens per setting (accept_len.json), where it has one."""
    path = RunDir(run_dir).accept_len
    settings = json.loads(path.read_text()).get("settings", {}) if path.exists() else {}
    return {k: v["tau_walk_loop_free"] for k, v in settings.items() if v.get("tau_walk_loop_free")}


def run(
    run_dir: Path, bench: BenchConfig | None = None, target: TargetConfig | None = None, tok_s: float | None = None
) -> tuple[Economics | None, dict | None]:
    """economics.json (+ calibration.json) from this run's summary, and the prediction when bench.calibration is set."""
    run_dir = Path(run_dir)
    offline, basis, intervals = read_offline_tau(RunDir(run_dir).accept_len)
    cal = from_config(bench)
    name = target.name if target is not None else None
    pred = write_prediction(run_dir, cal, offline, basis, intervals) if cal else None
    summary_path = RunDir(run_dir).bench_summary
    if not summary_path.exists():
        return None, pred
    summary = read_json(summary_path, "the benchmark summary")  # truncated: DamagedFile naming it
    if not isinstance(summary, dict):
        raise DamagedFile(f"{summary_path}: the benchmark summary is not a JSON object; rerun the bench")
    ec = analyse(summary, offline, cal, tok_s, name, basis, intervals, offline_loop_free(run_dir))
    mine = RunDir(run_dir.resolve()).calibration
    if ec.calibrated and (
        Path(cal["source_run"]).resolve() == run_dir.resolve()
        or any(Path(p).resolve() == mine for p in cal.get("pool", []))
    ):
        ec.calibrated["warnings"].append(
            "the calibration comes from this very run: its prediction restates the measurement"
        )
    write_json(RunDir(run_dir).economics, ec.to_dict(), indent=2)
    write_calibration(run_dir, summary, name)
    return ec, pred


def after_bench(
    run_dir: Path, bench: BenchConfig, target: TargetConfig, log: Callable[[str], None] = print
) -> Economics:
    """A finished bench's economics.json and calibration.json (and the prediction with bench.calibration), its table
    logged: what a bench's entry point runs once the bench is done."""
    ec, _ = run(run_dir, bench, target)
    log(format_table(ec))
    return ec


def decode_rate(text: str) -> float:
    """--tok-s: a finite number of tokens/s above 0 (argparse's error otherwise, before anything is written)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a decode rate in tokens/s, a finite number above 0")
    return value


def main(argv: list[str] | None = None) -> None:
    prog = command_name("analysis.py")  # in errors: the command the user typed

    desc = "Speculation economics from a benchmark run; with bench.calibration, tok/s predicted from offline tau."
    parser = build_parser(desc)
    parser.add_argument(
        "--tok-s",
        type=decode_rate,
        default=None,
        help="a decode throughput to price: the tau each setting needs for it",
    )
    cfg, run_dir, args = parse_cli(desc, stage="economics", argv=argv, parser=parser)
    check_or_exit(prog, "economics", cfg, run_dir, args.config)

    with holding(run_dir, "economics", prog), cli_errors(prog, log=error_log(run_dir, "economics")):
        try:
            # a damaged input file: one line naming it (cli_errors)
            ec, pred = run(run_dir, cfg.bench, cfg.target, args.tok_s)
        except CalibrationError as e:
            parser.exit(2, f"{prog}: error: {e}\n")
    if ec is not None:
        print(format_table(ec))
    elif pred is not None:
        print(format_prediction(pred))
        print(f"no {RunDir(run_dir).bench_summary} yet: this prediction is in {RunDir(run_dir).prediction}")


if __name__ == "__main__":
    main()
