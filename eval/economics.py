"""Speculation economics: when does a drafter pay for itself?

One speculative cycle drafts `steps` tokens (one drafter forward each; the first one is the
extend after the previous verify), verifies `num_draft_tokens` tokens with one target forward,
and emits tau tokens on average (bonus included, like SGLang's spec_accept_length):

    cycle_s(setting)   = steps * draft_forward_s + verify_s(num_draft_tokens) + overhead_s
    tok/s(tau)         = tau / cycle_s
    break-even tau     = cycle_s / baseline_s_per_token      (speculation == plain decoding)
    tau for R tok/s    = R * cycle_s

Worked example (tests/test_eval_economics.py): a 29 ms cycle at tau 2.0 gives 2.0/0.029 = 69 tok/s;
150 tok/s needs tau = 150 * 0.029 = 4.35; against a 82 tok/s baseline (12.195 ms/token) the
break-even tau is 0.029 * 82 = 2.38 (with 12.1 ms/token it is 29/12.1 = 2.40).

A tau is out of reach at a setting when it exceeds the most a cycle can emit: steps + 1 (every draft
accepted plus the bonus; at most num_draft_tokens for a tree). "tau 4.35 for 150 tok/s" cannot happen
at 2/1/3, whose tau is at most 3; `reach` names the shallowest chain where the needed tau fits.

Calibration (prediction, not restatement). Every benchmark saves RUN/bench/calibration.json: the
baseline step time and, per setting, the mean cycle (decode time / verifies, median over passes) and
the cost model. A later run with `--set bench.calibration=OTHER/bench/calibration.json` gets its
tok/s predicted from its offline tau alone, tok/s = tau_offline / cycle_calibrated, written to
RUN/bench/prediction.json before its own benchmark exists; once it does, economics.json holds the
prediction next to the measured figure with the error in percent (also predicted from the live tau,
which separates an error of the costs from an error of tau).

`python eval/economics.py --config CFG --run-dir RUN [--tok-s R]` reads RUN/bench/summary.json (and the
offline RUN/eval/accept_len.json when present), prints predicted against measured tok/s per setting
and writes RUN/bench/economics.json and RUN/bench/calibration.json; with bench.calibration and no
summary yet it prints and writes the prediction alone. --tok-s R: the tau each setting needs for R.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Setting:
    """SGLang's speculation knobs: --speculative-num-steps / -eagle-topk / -num-draft-tokens."""

    steps: int
    topk: int
    num_draft_tokens: int

    @property
    def key(self) -> str:
        return f"{self.steps}/{self.topk}/{self.num_draft_tokens}"

    @classmethod
    def of(cls, obj) -> "Setting":
        if isinstance(obj, Setting):
            return obj
        if isinstance(obj, dict):
            return cls(int(obj["steps"]), int(obj["topk"]), int(obj["num_draft_tokens"]))
        return cls(int(obj.steps), int(obj.topk), int(obj.num_draft_tokens))


@dataclass
class CostModel:
    """Measured costs. verify_s maps a number of verified tokens to the seconds of one target forward."""

    baseline_s_per_token: float
    verify_s: dict[int, float]
    draft_forward_s: float = 0.0
    overhead_s: float = 0.0  # per cycle: sampling, acceptance bookkeeping, cache crops

    def verify_time(self, num_tokens: int) -> float:
        """Seconds for one verify of `num_tokens`; linear between measured sizes, flat beyond them."""
        if not self.verify_s:
            raise ValueError("no verify costs measured")
        sizes = sorted(self.verify_s)
        if num_tokens in self.verify_s:
            return self.verify_s[num_tokens]
        if num_tokens <= sizes[0]:
            return self.verify_s[sizes[0]]
        if num_tokens >= sizes[-1]:
            return self.verify_s[sizes[-1]]
        i = bisect.bisect_left(sizes, num_tokens)
        lo, hi = sizes[i - 1], sizes[i]
        w = (num_tokens - lo) / (hi - lo)
        return (1 - w) * self.verify_s[lo] + w * self.verify_s[hi]

    def cycle_s(self, setting: Setting) -> float:
        return setting.steps * self.draft_forward_s + self.verify_time(setting.num_draft_tokens) + self.overhead_s

    @property
    def baseline_tok_s(self) -> float:
        return 1.0 / self.baseline_s_per_token

    def tok_per_s(self, tau: float, setting: Setting) -> float:
        return tau / self.cycle_s(setting)

    def break_even_tau(self, setting: Setting) -> float:
        return self.cycle_s(setting) / self.baseline_s_per_token

    def tau_for(self, tok_s: float, setting: Setting) -> float:
        return tok_s * self.cycle_s(setting)

    def speedup(self, tau: float, setting: Setting) -> float:
        return self.tok_per_s(tau, setting) / self.baseline_tok_s


def max_tau(setting: Setting) -> int:
    """The most one cycle can emit: every draft accepted plus the bonus (a tree verifies num_draft_tokens - 1 drafts)."""
    return min(setting.steps + 1, setting.num_draft_tokens)


CHAINS = [Setting(d, 1, d + 1) for d in range(1, 9)]
GOAL_SPEEDUPS = (1.0, 1.5, 2.0)  # speed-ups over plain decoding the report prices; 1.0 is break-even


def reach(cm: CostModel, tok_s: float, setting: Setting, candidates: list[Setting] = CHAINS) -> dict:
    """The tau `setting` needs for `tok_s`, whether a cycle can emit it, else the shallowest chain where it fits."""
    need = cm.tau_for(tok_s, setting)
    row = {
        "tok_s": tok_s,
        "speedup": tok_s / cm.baseline_tok_s,
        "setting": setting.key,
        "tau_needed": need,
        "max_tau": max_tau(setting),
    }
    row["reachable"] = need <= row["max_tau"]
    if not row["reachable"]:
        fits = [c for c in candidates if cm.tau_for(tok_s, c) <= max_tau(c)]
        row["needed_setting"] = fits[0].key if fits else None
        row["needed_setting_tau"] = cm.tau_for(tok_s, fits[0]) if fits else None
        # verify_time is flat beyond the largest measured size: a deeper setting's cycle is then a lower bound
        row["extrapolated"] = bool(fits) and fits[0].num_draft_tokens > max(cm.verify_s)
    return row


def reach_text(r: dict) -> str:
    head = f"{r['tok_s']:.1f} tok/s (x{r['speedup']:.2f}) needs tau {r['tau_needed']:.2f} at {r['setting']}"
    if r["reachable"]:
        return f"{head}, within its maximum {r['max_tau']}"
    out = f"{head}: out of reach, a {r['setting']} cycle emits at most {r['max_tau']} tokens"
    if r.get("needed_setting"):
        out += (
            f"; the shallowest chain where it fits is {r['needed_setting']} (tau {r['needed_setting_tau']:.2f} needed"
        )
        out += ", verify cost extrapolated beyond the measured sizes)" if r.get("extrapolated") else ")"
    else:
        out += f"; no chain up to {CHAINS[-1].key} reaches it at these costs"
    return out


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
    best_basis: str | None = None  # which tau chose the best setting: live or offline
    # every setting with an offline tau (benchmarked or not), priced with the measured costs
    offline_predictions: list[dict] = field(default_factory=list)
    reach: list[dict] = field(
        default_factory=list
    )  # the tau each benchmarked setting needs for GOAL_SPEEDUPS (and --tok-s)
    calibrated: dict | None = None  # this run's offline tau priced with another run's costs, against what it measured

    def to_dict(self) -> dict:
        return asdict(self)


def cost_model_from_summary(summary: dict) -> CostModel:
    """The cost model measured by eval/bench.py (bench/summary.json's `costs`)."""
    c = summary["costs"]
    return CostModel(
        baseline_s_per_token=c["baseline_s_per_token"],
        verify_s={int(k): v for k, v in c["verify_s"].items()},
        draft_forward_s=c.get("draft_forward_s") or 0.0,
        overhead_s=c.get("overhead_s") or 0.0,
    )


# --------------------------------------------------------------------------- calibration

CALIBRATION_SCHEMA = 1


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file."""


def calibration_from_summary(summary: dict, source_run: str, target: str | None = None) -> dict:
    """The costs of one benchmark run, per setting, for pricing another drafter's offline tau later."""
    env = summary.get("environment", {})
    settings = {}
    for r in summary["speculative"]:
        if r.get("cycle_s_per_pass"):
            cycle, basis = r["cycle_s_per_pass"], "decode time / verifies, median over passes"
        elif r.get("tau") and r.get("tok_s_median"):
            cycle, basis = r["tau"] / r["tok_s_median"], "tau live / tok/s median"
        else:
            continue
        settings[r["key"]] = {
            "cycle_s": cycle,
            "cycle_basis": basis,
            "tau_live": r.get("tau"),
            "tok_s_median": r.get("tok_s_median"),
        }
    return {
        "schema": CALIBRATION_SCHEMA,
        "source_run": source_run,
        "backend": summary.get("backend"),
        "target": target,
        "device": env.get("device"),
        "environment": {k: env[k] for k in ("torch", "transformers", "torch_threads", "code_version") if k in env},
        "prompts": {
            "source": summary.get("prompts", {}).get("source"),
            "count": summary.get("prompts", {}).get("count"),
        },
        "max_new_tokens": summary.get("max_new_tokens"),
        "baseline_s_per_token": summary["costs"]["baseline_s_per_token"],
        "baseline_tok_s": summary["baseline"]["tok_s_median"],
        "costs": summary["costs"],
        "settings": settings,
    }


def load_calibration(path: str | Path) -> dict:
    path = Path(path)
    try:
        cal = json.loads(path.read_text())
    except FileNotFoundError:
        raise CalibrationError(
            f"{path}: no such calibration file (bench.calibration; every eval/bench.py run writes RUN/bench/calibration.json)"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise CalibrationError(f"{path}: not a calibration file ({e})") from None
    missing = [k for k in ("schema", "baseline_s_per_token", "costs", "settings") if k not in cal]
    if missing or cal["schema"] != CALIBRATION_SCHEMA:
        raise CalibrationError(
            f"{path}: not a schema-{CALIBRATION_SCHEMA} calibration file (missing {missing or 'nothing'}, schema {cal.get('schema')})"
        )
    return {**cal, "path": str(path)}


def predict(cal: dict, offline_tau: dict[str, float]) -> dict:
    """tok/s = tau_offline / cycle per setting, with the calibration run's cycle (or its cost model where it did not run)."""
    cm = cost_model_from_summary(cal)
    rows = []
    for key, tau in sorted(offline_tau.items()):
        st = Setting(*map(int, key.split("/")))
        if key in cal["settings"]:
            cycle, basis = cal["settings"][key]["cycle_s"], "measured"
        else:
            cycle, basis = cm.cycle_s(st), "cost model"
        rows.append({
            "setting": key, "tau_offline": tau, "max_tau": max_tau(st), "cycle_ms": 1e3 * cycle, "cycle_basis": basis,
            "break_even_tau": cycle / cal["baseline_s_per_token"], "predicted_tok_s": tau / cycle,
            "predicted_speedup": tau / cycle * cal["baseline_s_per_token"],
        })  # fmt: skip
    keep = ("path", "source_run", "backend", "target", "device", "max_new_tokens", "baseline_tok_s")
    return {"calibration": {k: cal.get(k) for k in keep}, "rows": rows}


def _err(pred: float | None, meas: float | None) -> float | None:
    return 100.0 * (pred - meas) / meas if pred is not None and meas else None


def join(prediction: dict, summary: dict | None, target: str | None = None) -> dict:
    """The prediction next to what this run measured: error in percent of tok/s, of speed-up, and from the live tau."""
    out = {**prediction, "rows": [dict(r) for r in prediction["rows"]], "warnings": []}
    cal = prediction["calibration"]
    if summary is None:
        return out
    for k, mine in (
        ("backend", summary.get("backend")),
        ("device", summary.get("environment", {}).get("device")),
        ("max_new_tokens", summary.get("max_new_tokens")),
        ("target", target),
    ):
        if cal.get(k) is not None and mine is not None and cal[k] != mine:
            out["warnings"].append(f"{k} differs: calibration {cal[k]!r}, this run {mine!r}")
    measured = {r["key"]: r for r in summary["speculative"]}
    for r in out["rows"]:
        m = measured.get(r["setting"])
        if not m:
            continue
        cycle = r["cycle_ms"] / 1e3
        r.update(
            measured_tok_s=m.get("tok_s_median"), measured_speedup=m.get("speedup_median"), tau_live=m.get("tau"),
            error_pct=_err(r["predicted_tok_s"], m.get("tok_s_median")),
            speedup_error_pct=_err(r["predicted_speedup"], m.get("speedup_median")),
            predicted_tok_s_live_tau=m["tau"] / cycle if m.get("tau") else None,
            error_pct_live_tau=_err(m["tau"] / cycle if m.get("tau") else None, m.get("tok_s_median")),
        )  # fmt: skip
    return out


def analyse(
    summary: dict,
    offline_tau: dict[str, float] | None = None,
    calibration: dict | None = None,
    tok_s: float | None = None,
    target: str | None = None,
) -> Economics:
    """Predicted against measured for every benchmarked setting, and the best of them.

    `offline_tau` maps a setting key ("steps/topk/draft_tokens") to the offline accept length;
    `calibration` is another run's calibration.json (load_calibration); `tok_s` a throughput to price;
    `target` this run's target name, checked against the calibration's.
    """
    cm = cost_model_from_summary(summary)
    offline_tau = offline_tau or {}
    rows = []
    for s in summary["speculative"]:
        st = Setting.of(s["setting"])
        tau_live = s.get("tau")
        tau_off = offline_tau.get(st.key)
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
                measured_tok_s=s.get("tok_s_median"),
                measured_cycle_ms=1e3 * s["cycle_s"] if s.get("cycle_s") else None,
            )
        )
    best, basis = None, None
    for b in ("live", "offline"):
        scored = [
            (getattr(r, f"predicted_tok_s_{b}_tau"), r.setting) for r in rows if getattr(r, f"predicted_tok_s_{b}_tau")
        ]
        if scored:
            best, basis = max(scored)[1], b
            break
    offline_rows = []
    for key, tau in sorted(offline_tau.items()):
        st = Setting(*map(int, key.split("/")))
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
    calibrated = join(predict(calibration, offline_tau), summary, target) if calibration else None
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
    )


def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def format_table(ec: Economics) -> str:
    lines = [
        f"baseline {ec.baseline_tok_s:.1f} tok/s ({ec.baseline_ms_per_token:.2f} ms/token); "
        f"draft forward {ec.draft_forward_ms:.2f} ms; cycle overhead {ec.overhead_ms:.2f} ms",
        "verify ms by tokens: " + ", ".join(f"{k}: {v:.2f}" for k, v in ec.verify_ms.items()),
        f"{'setting':>9} {'cycle ms':>9} {'meas. cyc':>9} {'break-even':>10} {'tau live':>8} {'tau off':>8} "
        f"{'pred(live)':>10} {'pred(off)':>10} {'measured':>9}",
    ]
    for r in ec.settings:
        lines.append(
            f"{r.setting:>9} {r.cycle_ms:>9.2f} {_f(r.measured_cycle_ms):>9} {r.break_even_tau:>10.2f} {_f(r.tau_live):>8} "
            f"{_f(r.tau_offline):>8} {_f(r.predicted_tok_s_live_tau, '{:.1f}'):>10} "
            f"{_f(r.predicted_tok_s_offline_tau, '{:.1f}'):>10} {_f(r.measured_tok_s, '{:.1f}'):>9}"
        )
    if ec.best_setting:
        lines.append(f"best measured setting by predicted tok/s ({ec.best_basis} tau): {ec.best_setting}")
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


def format_prediction(p: dict) -> str:
    c = p["calibration"]
    lines = [
        f"predicted from offline tau with the costs of {c['source_run']} ({c['backend']}, {c['device']}; {c['path']}):"
    ]
    lines += [f"  warning: {w}" for w in p.get("warnings", [])]
    for r in p["rows"]:
        line = f"  {r['setting']:>7} tau offline {r['tau_offline']:.2f} x cycle {r['cycle_ms']:.2f} ms ({r['cycle_basis']}) -> {r['predicted_tok_s']:.1f} tok/s (x{r['predicted_speedup']:.2f})"
        if r.get("measured_tok_s") is not None:
            line += f"; measured {r['measured_tok_s']:.1f} (x{_f(r['measured_speedup'])}), error {r['error_pct']:+.1f}% (speed-up {_f(r['speedup_error_pct'], '{:+.1f}')}%, from live tau {_f(r['error_pct_live_tau'], '{:+.1f}')}%)"
        lines.append(line)
    return "\n".join(lines)


def offline_tau_by_setting(accept_len_json: Path) -> dict[str, float]:
    if not accept_len_json.exists():
        return {}
    doc = json.loads(accept_len_json.read_text())
    return {k: v["tau"] for k, v in doc.get("settings", {}).items()}


def write_calibration(run_dir: Path, summary: dict, target: str | None = None) -> Path:
    out = Path(run_dir) / "bench" / "calibration.json"
    out.write_text(json.dumps(calibration_from_summary(summary, str(run_dir), target), indent=2))
    return out


def write_prediction(run_dir: Path, cal: dict, offline_tau: dict[str, float]) -> dict:
    """RUN/bench/prediction.json: made_before_bench stays true while the prediction is unchanged."""
    out = Path(run_dir) / "bench" / "prediction.json"
    pred = predict(cal, offline_tau)
    before = not (Path(run_dir) / "bench" / "summary.json").exists()
    if out.exists():
        old = json.loads(out.read_text())
        before = before or (old.get("made_before_bench", False) and old.get("rows") == pred["rows"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"made_before_bench": before, **pred}, indent=2))
    return {"made_before_bench": before, **pred}


def run(run_dir: Path, cfg=None, tok_s: float | None = None) -> tuple[Economics | None, dict | None]:
    """economics.json (+ calibration.json) from this run's summary, and the prediction when bench.calibration is set."""
    from eagle3ft.config import resolve_path

    run_dir = Path(run_dir)
    offline = offline_tau_by_setting(run_dir / "eval" / "accept_len.json")
    cal = load_calibration(resolve_path(cfg.bench.calibration)) if cfg is not None and cfg.bench.calibration else None
    target = cfg.target.name if cfg is not None else None
    pred = write_prediction(run_dir, cal, offline) if cal else None
    summary_path = run_dir / "bench" / "summary.json"
    if not summary_path.exists():
        return None, pred
    summary = json.loads(summary_path.read_text())
    ec = analyse(summary, offline, cal, tok_s, target)
    if ec.calibrated and Path(cal["source_run"]).resolve() == run_dir.resolve():
        ec.calibrated["warnings"].append(
            "the calibration comes from this very run: its prediction restates the measurement"
        )
    (run_dir / "bench" / "economics.json").write_text(json.dumps(ec.to_dict(), indent=2))
    write_calibration(run_dir, summary, target)
    return ec, pred


def main(argv: list[str] | None = None) -> None:
    from eagle3ft.config import build_parser, parse_cli
    from eagle3ft.eval.preflight import check_or_exit

    desc = "Speculation economics from a benchmark run; with bench.calibration, tok/s predicted from offline tau."
    parser = build_parser(desc)
    parser.add_argument(
        "--tok-s", type=float, default=None, help="a decode throughput to price: the tau each setting needs for it"
    )
    cfg, run_dir, args = parse_cli(desc, stage="economics", argv=argv, parser=parser)
    check_or_exit("economics.py", "economics", cfg, run_dir, args.config)
    from eagle3ft.runlock import holding

    try:
        with holding(run_dir, "economics", "economics.py"):
            ec, pred = run(run_dir, cfg, args.tok_s)
    except CalibrationError as e:
        parser.exit(2, f"economics.py: error: {e}\n")
    if ec is not None:
        print(format_table(ec))
    elif pred is not None:
        print(format_prediction(pred))
        print(
            f"no {run_dir / 'bench' / 'summary.json'} yet: this prediction is in {run_dir / 'bench' / 'prediction.json'}"
        )


if __name__ == "__main__":
    main()
