"""τ against training data: fit τ = a + b·ln(answer tokens) per held-out set and setting, over several runs.

    python benchmarks/tau_curve.py RUN [RUN ...] [--points FILE] [--gain 0.2] [--out DIR]

Each RUN folder gives one data size and its τ:
  answer tokens  what the trainer recorded in RUN/train/data.json (its train split, or the seeded subset that
                 train.max_answer_tokens took); for older runs, the loss-masked tokens of RUN/features' train
                 split; the epochs it trained (data.json, else RUN/config.yaml) are shown beside them;
  τ              per setting ("1/1/2", "3/1/4", ...) from RUN/eval/accept_len.json (set "heldout") and from
                 RUN/eval/accept_len-<set>.json (set <set>, e.g. accept_len-humaneval.json), their "settings".
--points adds (or replaces) points from a JSON list of {"run", "tokens", "set", "setting", "tau"} records.

The fit is least squares in ln(tokens). Its slope b is τ per e-fold of data, so a gain g in τ takes
exp(g / b) times the data, wherever on the curve one stands: the table gives that factor and the answer tokens
it means from the largest run. A fit from fewer than 2 data sizes, or with b ≤ 0, predicts nothing (shown as -).
Writes DIR/tau_curve.json and DIR/tau_curve.png (one panel per set, one line per setting); prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from eagle3ft.config_train import MISSING, written_value


@dataclass
class Point:
    run: str
    tokens: float  # answer tokens trained on (distinct)
    set: str
    setting: str  # steps/topk/draft tokens
    tau: float
    epochs: float | None = None


@dataclass
class Fit:
    set: str
    setting: str
    n: int  # data sizes
    a: float  # τ at 1 token (intercept in ln tokens)
    b: float  # τ per e-fold of answer tokens
    r2: float | None
    max_tokens: float
    tau_at_max: float  # the fitted τ at the largest run
    data_factor: float | None  # exp(gain / b): how many times the data the next `gain` τ takes
    tokens_for_gain: float | None  # max_tokens × data_factor


def train_answer_tokens(run: Path) -> int:
    """The answer tokens the run trained on: RUN/train/data.json, else the loss-masked tokens of the train split of
    RUN/features (each shard's loss_mask, nothing else read)."""
    from safetensors import safe_open

    if (run / "train" / "data.json").is_file():
        return int(json.loads((run / "train" / "data.json").read_text())["answer_tokens"])
    feats = run / "features"
    manifest = json.loads((feats / "manifest.json").read_text())
    total = 0
    for shard in manifest["shards"]:
        if shard["split"] != "train":
            continue
        with safe_open(str(feats / shard["file"]), framework="pt") as f:
            total += int(f.get_tensor("loss_mask").sum())
    return total


def trained_epochs(run: Path) -> float | None:
    if (run / "train" / "data.json").is_file():
        return json.loads((run / "train" / "data.json").read_text()).get("epochs")
    p = run / "config.yaml"
    if not p.is_file():
        return None
    train = (
        ((yaml.safe_load(p.read_text()) or {}).get("stages", {}).get("train") or {}).get("config", {}).get("train", {})
    )
    epochs, max_steps = written_value(train, "schedule.epochs"), written_value(train, "schedule.max_steps")
    return epochs if epochs is not MISSING and max_steps in (None, MISSING) else None


def run_points(run: Path) -> list[Point]:
    """One point per (set, setting) of RUN/eval/accept_len*.json."""
    files = sorted((run / "eval").glob("accept_len*.json"))
    if not files:
        raise FileNotFoundError(f"{run}/eval: no accept_len*.json (python eval/offline/accept_len.py --run-dir {run})")
    tokens, epochs = train_answer_tokens(run), trained_epochs(run)
    out = []
    for f in files:
        name = f.stem.removeprefix("accept_len").removeprefix("-") or "heldout"
        for setting, v in json.loads(f.read_text()).get("settings", {}).items():
            out.append(Point(str(run), tokens, name, setting, float(v["tau"]), epochs))
    return out


def fit_line(x: list[float], y: list[float]) -> tuple[float, float, float | None]:
    """(a, b, R²) of y = a + b·x by least squares; b = 0 and R² None for fewer than 2 distinct x."""
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((xi - mx) ** 2 for xi in x)
    if sxx == 0:
        return my, 0.0, None
    b = sum((xi - mx) * (yi - my) for xi, yi in zip(x, y)) / sxx
    a = my - b * mx
    syy = sum((yi - my) ** 2 for yi in y)
    r2 = 1 - sum((yi - a - b * xi) ** 2 for xi, yi in zip(x, y)) / syy if syy > 0 else 1.0
    return a, b, r2


def fit_all(points: list[Point], gain: float) -> list[Fit]:
    groups: dict[tuple[str, str], list[Point]] = {}
    for p in points:
        groups.setdefault((p.set, p.setting), []).append(p)
    fits = []
    for (name, setting), ps in sorted(groups.items(), key=lambda kv: (kv[0][0], [int(x) for x in kv[0][1].split("/")])):
        x, y = [math.log(p.tokens) for p in ps], [p.tau for p in ps]
        a, b, r2 = fit_line(x, y)
        top = max(p.tokens for p in ps)
        factor = math.exp(gain / b) if b > 0 and len(set(x)) >= 2 else None
        fits.append(
            Fit(
                name,
                setting,
                len(set(x)),
                a,
                b,
                r2,
                top,
                a + b * math.log(top),
                factor,
                top * factor if factor else None,
            )
        )
    return fits


def _si(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, s in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= unit:
            return f"{n / unit:.3g}{s}"
    return f"{n:.3g}"


def table(points: list[Point], fits: list[Fit], gain: float) -> str:
    lines = ["runs:", f"  {'answer tokens':>13} {'epochs':>6}  run"]
    for run, tok, ep in sorted({(p.run, p.tokens, p.epochs) for p in points}, key=lambda r: r[1]):
        lines.append(f"  {_si(tok):>13} {('-' if ep is None else f'{ep:g}'):>6}  {run}")
    lines += ["", f"fit tau = a + b*ln(answer tokens); the next +{gain:g} tau takes exp({gain:g}/b) times the data", ""]
    lines.append(
        f"{'set':<12} {'setting':<8} {'sizes':>5} {'tau@max':>7} {'b/e-fold':>8} {'b/x2':>6} {'R2':>5} {'x data':>7} "
        f"{'tokens':>8}"
    )
    for f in fits:
        r2 = "-" if f.r2 is None else f"{f.r2:.2f}"
        xd = "-" if f.data_factor is None else f"{f.data_factor:.3g}"
        lines.append(
            f"{f.set:<12} {f.setting:<8} {f.n:>5} {f.tau_at_max:>7.3f} {f.b:>8.3f} {f.b * math.log(2):>6.3f} {r2:>5} "
            f"{xd:>7} {_si(f.tokens_for_gain):>8}"
        )
    return "\n".join(lines)


def plot(points: list[Point], fits: list[Fit], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = sorted({p.set for p in points})
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4), squeeze=False)
    for ax, name in zip(axes[0], sets):
        for i, f in enumerate(x for x in fits if x.set == name):
            ps = sorted((p for p in points if p.set == name and p.setting == f.setting), key=lambda p: p.tokens)
            color = f"C{i}"
            ax.scatter(
                [p.tokens for p in ps], [p.tau for p in ps], color=color, label=f"{f.setting} (b={f.b:.3f}/e-fold)"
            )
            lo, hi = ps[0].tokens, (f.tokens_for_gain or ps[-1].tokens)
            xs = [lo * (hi / lo) ** (k / 50) for k in range(51)] if hi > lo else [lo]
            ax.plot(xs, [f.a + f.b * math.log(x) for x in xs], color=color, linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("answer tokens trained on")
        ax.set_ylabel("offline tau (chain, greedy)")
        ax.set_title(f"held-out set: {name}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="Fit offline tau against log(answer tokens) over several runs.")
    ap.add_argument("runs", nargs="*", type=Path, help="run folders (RUN/features, RUN/eval/accept_len*.json)")
    ap.add_argument("--points", type=Path, help="a JSON list of {run, tokens, set, setting, tau} records")
    ap.add_argument("--gain", type=float, default=0.2, help="the tau gain to price in data (default 0.2)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/tau_curve"))
    a = ap.parse_args(argv)
    points = [p for run in a.runs for p in run_points(run)]
    if a.points:
        points += [
            Point(**{k: r.get(k) for k in ("run", "tokens", "set", "setting", "tau", "epochs")})
            for r in json.loads(a.points.read_text())
        ]
    if not points:
        ap.error("no points: name run folders or --points")
    fits = fit_all(points, a.gain)
    a.out.mkdir(parents=True, exist_ok=True)
    result = {"gain": a.gain, "points": [asdict(p) for p in points], "fits": [asdict(f) for f in fits]}
    (a.out / "tau_curve.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(points, fits, a.out / "tau_curve.png")
    print(table(points, fits, a.gain))
    print(f"\nwrote {a.out / 'tau_curve.json'} and {a.out / 'tau_curve.png'}")
    return result


if __name__ == "__main__":
    main()
