"""Calibration (prediction, not restatement): one benchmark run's costs, kept to price another drafter's offline tau.

Every benchmark saves RUN/bench/calibration.json: the
baseline step time and, per setting, the mean cycle (decode time / verifies, median over passes) and
the cost model. A later run with `--set bench.calibration=OTHER/bench/calibration.json` gets its
tok/s predicted from its offline tau alone, tok/s = tau_offline / cycle_calibrated, written to
RUN/bench/prediction.json before its own benchmark exists; once it does, economics.json holds the
prediction next to the measured figure with the error in percent (also predicted from the live tau,
which separates an error of the costs from an error of tau). The speed-up is predicted from the cycle in plain steps
(each repetition's cycle over its own plain pass's step, median over repetitions: a host that runs slower for a while
slows both) and held against the measured speed-up of each repetition over its own plain pass (`speedup_paired`).
Priced at this run's plain tok/s (`predicted_tok_s_at_plain`), the same speed-up gives tok/s without the host's drift
between the two runs: no speculative figure of this run goes in, only its plain pass.

A calibration of 16 prompts pins a setting's cycle to about 5-10% (2.49-2.82 plain steps for 7/1/8 over seven runs
of one plan on one GPU). `bench.calibration_pool` lists earlier runs' calibration.json files of the same backend,
target and answer length: each setting's cycle in plain steps is then their mean with bench.calibration's, weighted by
prompts, and priced at bench.calibration's plain step (the host of the latest run; `pool`). A pooled SGLang run
whose servers ran other args than bench.calibration's is named in the prediction's warnings.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3ft.config import BenchConfig, resolve_path
from eagle3ft.eval.economics.cost_model import cost_model_from_summary, fmt, max_tau
from eagle3ft.files import write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.setting import Setting

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
            "cycle_plain_steps": r.get("cycle_plain_steps"),  # the cycle in the same repetition's plain steps
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
        "servers": env.get("servers"),  # SGLang: each server's version and main args, for a pool to compare
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
            f"{path}: no such calibration file (bench.calibration; every eval/bench/live.py run writes "
            "RUN/bench/calibration.json)"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise CalibrationError(f"{path}: not a calibration file ({e})") from None
    missing = [k for k in ("schema", "baseline_s_per_token", "costs", "settings") if k not in cal]
    if missing or cal["schema"] != CALIBRATION_SCHEMA:
        raise CalibrationError(
            f"{path}: not a schema-{CALIBRATION_SCHEMA} calibration file (missing {missing or 'nothing'}, schema "
            f"{cal.get('schema')})"
        )
    return {**cal, "path": str(path)}


POOL_MUST_MATCH = ("backend", "target", "max_new_tokens")
SERVER_ARGS_PER_RUN = {"model_path", "speculative_draft_model_path", "mem_fraction_static", "max_running_requests"}


def _server_differences(cal: dict, latest: dict) -> list[str]:
    """What `cal`'s SGLang servers ran with that `latest`'s did not, per role both have (older files record none)."""
    mine, theirs = cal.get("servers") or {}, latest.get("servers") or {}
    out = []
    for role in sorted(set(mine) & set(theirs)):
        keys = sorted(
            k
            for k in set(mine[role]) | set(theirs[role])
            if k not in SERVER_ARGS_PER_RUN and mine[role].get(k) != theirs[role].get(k)
        )
        if keys:
            out.append(f"{cal['path']}: its {role} server differs from bench.calibration's in {', '.join(keys)}")
    return out


def pool(latest: dict, earlier: list[dict]) -> dict:
    """`latest` with the cycle of each setting it ran in plain steps averaged over it and `earlier` (weighted by their
    prompts), priced at latest's plain step: a cycle in plain steps carries from run to run, the host's speed does not.
    """
    if not earlier:
        return latest
    for cal in earlier:
        for k in POOL_MUST_MATCH:
            if cal.get(k) != latest.get(k):
                raise CalibrationError(
                    f"{cal['path']}: {k} {cal.get(k)!r}, where bench.calibration {latest['path']} has "
                    f"{latest.get(k)!r}: only runs of one backend, target and answer length pool"
                )
    runs = [latest, *earlier]
    settings = {}
    for key, row in latest["settings"].items():
        got = [
            (c["settings"][key]["cycle_plain_steps"], (c.get("prompts") or {}).get("count") or 1, c["path"])
            for c in runs
            if (c["settings"].get(key) or {}).get("cycle_plain_steps")
        ]
        if not got or not row.get("cycle_plain_steps"):
            settings[key] = row
            continue
        steps = sum(s * w for s, w, _ in got) / sum(w for _, w, _ in got)
        settings[key] = {
            **row,
            "cycle_s": steps * latest["baseline_s_per_token"],
            "cycle_plain_steps": steps,
            "cycle_basis": f"plain steps pooled over {len(got)} run" + "s" * (len(got) != 1),
            "pooled_from": [{"path": path, "prompts": w, "cycle_plain_steps": s} for s, w, path in got],
        }
    warnings = [w for c in earlier for w in _server_differences(c, latest)]
    return {**latest, "settings": settings, "pool": [c["path"] for c in earlier], "pool_warnings": warnings}


def from_config(bench: BenchConfig | None) -> dict | None:
    """bench.calibration, pooled with bench.calibration_pool's files; None without bench.calibration."""
    if bench is None:
        return None
    if bench.calibration_pool and not bench.calibration:
        raise CalibrationError("bench.calibration_pool needs bench.calibration: the run whose plain step prices it")
    if not bench.calibration:
        return None
    latest = load_calibration(resolve_path(bench.calibration))
    return pool(latest, [load_calibration(resolve_path(p)) for p in bench.calibration_pool])


def predict(
    cal: dict, offline_tau: dict[str, float], tau_basis: str = "cycle walk", intervals: dict | None = None
) -> dict:
    """tok/s = tau_offline / cycle per setting, with the calibration run's cycle (or its cost model where it did not
    run). tau_basis names what tau_offline is: "cycle walk" (what a live decoder sees) or "every root"; `intervals`
    maps a setting to the walk's 90% interval over the prompts drawn again (accept_len.walk_interval), priced alike."""
    cm = cost_model_from_summary(cal)
    intervals = intervals or {}
    rows = []
    for key, tau in sorted(offline_tau.items()):
        st = Setting.parse(key)
        steps = None
        if key in cal["settings"]:
            cycle, basis = cal["settings"][key]["cycle_s"], "measured"
            steps = cal["settings"][key].get("cycle_plain_steps")
            if "pooled_from" in cal["settings"][key]:
                basis = f"measured, {cal['settings'][key]['cycle_basis']}"
        else:
            cycle, basis = cm.cycle_s(st), "cost model"
        steps = steps or cycle / cal["baseline_s_per_token"]  # a cycle in plain steps: what the speed-up divides by
        iv = intervals.get(key)
        rows.append({
            "setting": key, "tau_offline": tau, "max_tau": max_tau(st), "cycle_ms": 1e3 * cycle, "cycle_basis": basis,
            "break_even_tau": steps, "predicted_tok_s": tau / cycle,
            "predicted_speedup": tau / steps, "tau_offline_interval": iv,
            "predicted_tok_s_interval": [iv[0] / cycle, iv[1] / cycle] if iv else None,
        })  # fmt: skip
    keep = ("path", "source_run", "backend", "target", "device", "max_new_tokens", "baseline_tok_s", "pool")
    return {
        "calibration": {k: cal.get(k) for k in keep}, "tau_basis": tau_basis, "rows": rows, "pick": pick(rows),
        "warnings": list(cal.get("pool_warnings", [])),
    }  # fmt: skip


def pick(rows: list[dict]) -> dict | None:
    """The setting the economics picks: the highest predicted speed-up among the settings the calibration ran (the
    cost model's other settings are interpolations no run has checked), with the tau it needs to break even."""
    ran = [r for r in rows if r["cycle_basis"].startswith("measured")] or rows
    if not ran:
        return None
    best = max(ran, key=lambda r: r["predicted_speedup"])
    return {k: best[k] for k in ("setting", "predicted_speedup", "predicted_tok_s", "break_even_tau", "tau_offline")}


def _err(pred: float | None, meas: float | None) -> float | None:
    return 100.0 * (pred - meas) / meas if pred is not None and meas else None


def join(prediction: dict, summary: dict | None, target: str | None = None) -> dict:
    """The prediction next to what this run measured: error in percent of tok/s, of speed-up, and from the live tau."""
    out = {
        **prediction,
        "rows": [dict(r) for r in prediction["rows"]],
        "warnings": list(prediction.get("warnings", [])),
    }
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
    plain = summary.get("baseline", {}).get("tok_s_median")
    if cal.get("baseline_tok_s") and plain:  # the host's own drift between the runs, with no drafter in it
        out["baseline"] = {
            "calibration_tok_s": cal["baseline_tok_s"], "measured_tok_s": plain,
            "error_pct": _err(cal["baseline_tok_s"], plain),
        }  # fmt: skip
    measured = {r["key"]: r for r in summary["speculative"]}
    for r in out["rows"]:
        m = measured.get(r["setting"])
        if not m:
            continue
        cycle = r["cycle_ms"] / 1e3
        paired = (m.get("speedup_paired") or {}).get("median")  # the speed-up of each repetition's own plain pass
        speedup = paired or m.get("speedup_median")
        r.update(
            measured_tok_s=m.get("tok_s_median"), measured_speedup=speedup, tau_live=m.get("tau"),
            measured_speedup_basis="paired" if paired else "median over median",
            error_pct=_err(r["predicted_tok_s"], m.get("tok_s_median")),
            speedup_error_pct=_err(r["predicted_speedup"], speedup),
            predicted_tok_s_live_tau=m["tau"] / cycle if m.get("tau") else None,
            error_pct_live_tau=_err(m["tau"] / cycle if m.get("tau") else None, m.get("tok_s_median")),
        )  # fmt: skip
        if plain:  # the predicted speed-up at this run's plain tok/s: the cycle in plain steps, the host of now
            r["predicted_tok_s_at_plain"] = r["predicted_speedup"] * plain
            r["error_pct_at_plain"] = _err(r["predicted_tok_s_at_plain"], m.get("tok_s_median"))
        iv = r.get("predicted_tok_s_interval")
        if iv and m.get("tok_s_median") is not None:
            r["measured_in_interval"] = iv[0] <= m["tok_s_median"] <= iv[1]
    chosen = next((r for r in out["rows"] if out.get("pick") and r["setting"] == out["pick"]["setting"]), None)
    if chosen and chosen.get("measured_speedup") is not None:
        out["pick"] = {**out["pick"], "measured_speedup": chosen["measured_speedup"], "tau_live": chosen["tau_live"]}
    return out


def format_prediction(p: dict) -> str:
    c = p["calibration"]
    lines = [
        f"predicted from offline tau ({p.get('tau_basis', 'every root')}) with the costs of {c['source_run']} "
        f"({c['backend']}, {c['device']}; {c['path']}"
        + (f"; cycles in plain steps pooled with {', '.join(c['pool'])}" if c.get("pool") else "")
        + "):"
    ]
    lines += [f"  warning: {w}" for w in p.get("warnings", [])]
    for r in p["rows"]:
        tau_iv, tok_iv = r.get("tau_offline_interval"), r.get("predicted_tok_s_interval")
        line = (
            f"  {r['setting']:>7} tau offline {r['tau_offline']:.2f}"
            + (f" ({tau_iv[0]:.2f}-{tau_iv[1]:.2f})" if tau_iv else "")
            + f" x cycle {r['cycle_ms']:.2f} ms ({r['cycle_basis']}) -> {r['predicted_tok_s']:.1f} tok/s"
            + (f" ({tok_iv[0]:.1f}-{tok_iv[1]:.1f})" if tok_iv else "")
            + f" (x{r['predicted_speedup']:.2f})"
        )
        if r.get("measured_tok_s") is not None:
            line += (
                f"; measured {r['measured_tok_s']:.1f} (x{fmt(r['measured_speedup'])}), error "
                f"{r['error_pct']:+.1f}% (speed-up {fmt(r['speedup_error_pct'], '{:+.1f}')}%, from live tau "
                f"{fmt(r['error_pct_live_tau'], '{:+.1f}')}%"
                + (f", at this run's plain speed {r['error_pct_at_plain']:+.1f}%" if "error_pct_at_plain" in r else "")
                + ")"
            )
            if "measured_in_interval" in r:
                line += ", inside the range" if r["measured_in_interval"] else ", outside the range"
        lines.append(line)
    if any(r.get("tau_offline_interval") for r in p["rows"]):
        lines.append(
            "  (ranges: 90% of the offline tau over the prompts drawn again, as many: how far tau moves on another "
            "draw, a scale for a live bench whose answers part from the plain ones)"
        )
    if p.get("baseline"):
        b = p["baseline"]
        lines.append(
            f"  plain decoding: {b['calibration_tok_s']:.1f} tok/s in the calibration, {b['measured_tok_s']:.1f} here "
            f"({b['error_pct']:+.1f}%: the host's drift between the two runs, the same for every setting's tok/s; "
            f"\"at this run's plain speed\" prices the calibrated cycle in plain steps at this run's plain tok/s)"
        )
    if p.get("pick"):
        k = p["pick"]
        line = (
            f"  the economics picks {k['setting']}: predicted x{k['predicted_speedup']:.2f}, where it breaks even at "
            f"tau {k['break_even_tau']:.2f} (offline {k['tau_offline']:.2f})"
        )
        if k.get("measured_speedup") is not None:
            line += f"; measured x{k['measured_speedup']:.2f} at live tau {fmt(k.get('tau_live'))}"
        lines.append(line)
    return "\n".join(lines)


def write_calibration(run_dir: Path, summary: dict, target: str | None = None) -> Path:
    out = RunDir(run_dir).calibration
    write_json(out, calibration_from_summary(summary, str(run_dir), target), indent=2)
    return out


def write_prediction(
    run_dir: Path,
    cal: dict,
    offline_tau: dict[str, float],
    tau_basis: str = "cycle walk",
    intervals: dict | None = None,
) -> dict:
    """RUN/bench/prediction.json: made_before_bench stays true while the prediction is unchanged."""
    out = RunDir(run_dir).prediction
    pred = predict(cal, offline_tau, tau_basis, intervals)
    before = not RunDir(run_dir).bench_summary.exists()
    if out.exists():
        old = json.loads(out.read_text())
        before = before or (old.get("made_before_bench", False) and old.get("rows") == pred["rows"])
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, {"made_before_bench": before, **pred}, indent=2)
    return {"made_before_bench": before, **pred}
