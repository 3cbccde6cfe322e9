"""The verdict before shipping a fine-tune: the drafter before and after, per held-out prompt set.

    eagle3ft-compare --config CFG --run-dir RUN [--before DIR] [--after DIR] [--out FILE]

`--before` defaults to drafter.init (the drafter the fine-tune started from), `--after` to eval.checkpoint (the
run's export); both are measured on RUN's held-out features, each sample in the set of the source it was harvested
from (data/sources.py sample_sources). Per set, at the eval setting's greedy chain (eval.steps/1/eval.steps+1):
- τ as a live decoder walks the answers cycle by cycle (eval/offline/accept_len.py's walk), on all answer tokens and on
  the loop-free ones (data/loops.py), before -> after;
- the change, and its 90% interval over the conversations drawn again (a paired bootstrap: the same draw for both
  drafters, counts summed over the drawn conversations before any ratio);
- the break-even τ from the run's measured costs where the run has any (RUN/bench/summary.json per prompt set, else
  RUN/bench/economics.json per setting): a τ above it makes speculation faster than plain decoding;
and one line: which sets gained, which lost (their interval above or below no change), which did not move clearly,
and by how much. Writes the figures to RUN/eval/compare.json (or --out) and prints the table and the line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3ft.cli import build_parser, cli_errors, command_name, error_log, parse_cli
from eagle3ft.config import Config, EvalConfig, HarvestConfig, TargetConfig, resolve_path
from eagle3ft.data.sources import heldout_sets
from eagle3ft.data.store import FeatureStore, StoreError
from eagle3ft.drafter.folder import DrafterFolder
from eagle3ft.eval.offline.accept_len import walk_totals
from eagle3ft.eval.offline.dflash_accept import dflash_walk_totals
from eagle3ft.files import DamagedFile, read_json, write_json
from eagle3ft.run_dir import RunDir

LEVEL = 0.9
RESAMPLES = 2000


@dataclass
class SetTotals:
    """One drafter's cycle walk on one held-out set, per conversation: (tokens, cycles, loop-free tokens,
    loop-free cycles), as eval/offline/accept_len.py's walk counts them."""

    per_sample: list[tuple[float, float, float, float]]

    def sums(self, idx: torch.Tensor | None = None) -> torch.Tensor:
        t = torch.tensor(self.per_sample, dtype=torch.float64).reshape(-1, 4)  # (n, 4)
        return (t if idx is None else t[idx]).sum(-2)  # (..., 4)

    @staticmethod
    def taus(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(τ on all tokens, τ on the loop-free ones) from summed counts (..., 4)."""
        return sums[..., 0] / sums[..., 1].clamp_min(1e-12), sums[..., 2] / sums[..., 3].clamp_min(1e-12)


def measure(drafter, items, steps: int, device, head=None) -> SetTotals:
    """The walk of `drafter` over the held-out items at steps/1/steps+1; a DFlash drafter's (`head`: the target's
    embedding and LM head) is its live chain walk over blocks (eval/offline/dflash_accept.py)."""
    if head is not None:
        return SetTotals([dflash_walk_totals(drafter, item, *head, device) for item in items])

    return SetTotals([walk_totals(drafter, item, steps, device) for item in items])


def change(before: SetTotals, after: SetTotals, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0):
    """The figures of one set: τ before and after (all tokens, loop-free), the relative change and its `level`
    interval over the conversations drawn again with replacement, the same draw for both drafters."""
    n = len(before.per_sample)
    if n != len(after.per_sample):
        raise ValueError(f"{n} conversations before, {len(after.per_sample)} after: the same set must be measured")
    b_all, b_free = SetTotals.taus(before.sums())
    a_all, a_free = SetTotals.taus(after.sums())
    out = {
        "conversations": n,
        "tokens": int(before.sums()[0]),
        "loop_free_tokens": float(before.sums()[2]),
        "tau": {"before": float(b_all), "after": float(a_all)},
        "tau_loop_free": {"before": float(b_free), "after": float(a_free)},
    }
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(n, (resamples, n), generator=g)  # (resamples, n): conversations drawn again
    q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    draws = [SetTotals.taus(before.sums(idx)), SetTotals.taus(after.sums(idx))]  # each (all, loop-free) (resamples,)
    for which, k in (("tau", 0), ("tau_loop_free", 1)):
        b, a = out[which]["before"], out[which]["after"]
        rel = draws[1][k] / draws[0][k].clamp_min(1e-12) - 1
        interval = torch.quantile(rel, q).tolist() if n >= 2 else None  # one conversation: no spread to measure
        out[which].update({"change": a - b, "relative": a / b - 1 if b else None, "interval": interval})
    return out


def break_even(run_dir: Path, setting: str, label: str | None = None) -> dict[str, float]:
    """Break-even τ (cycle time over a plain step) at `setting` from the run's measured costs: per prompt set of
    RUN/bench/summary.json (the drafter `label` where it was timed, else the first), and under "" the setting's
    from RUN/bench/economics.json. Empty when the run measured none."""
    out: dict[str, float] = {}
    econ, summary = RunDir(run_dir).economics, RunDir(run_dir).bench_summary
    reading = econ  # the file a malformed entry is named in
    try:
        if econ.is_file():
            for s in read_json(econ, "the economics").get("settings", []):
                if s.get("setting") == setting and s.get("break_even_tau"):
                    out[""] = float(s["break_even_tau"])
        if summary.is_file():
            reading = summary
            for name, pset in (read_json(summary, "the benchmark summary").get("prompt_sets") or {}).items():
                drafters = pset.get("drafters") or {}
                for d in [drafters[label]] if label in drafters else list(drafters.values())[:1]:
                    row = next((r for r in d.get("speculative", []) if r.get("key") == setting), None)
                    cycle = row and (row.get("cycle_s_per_pass") or row.get("cycle_s"))
                    if cycle:
                        out[name] = float(cycle) / (float(pset["baseline"]["ms_per_token"]) / 1e3)
    except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        if isinstance(e, DamagedFile):
            raise
        raise DamagedFile(
            f"{reading}: not the form its stage writes ({type(e).__name__}: {e}); rerun that stage"
        ) from None
    return out


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _interval(iv: list[float] | None) -> str:
    return "[no interval: one conversation]" if iv is None else f"[{_pct(iv[0])}, {_pct(iv[1])}]"


def verdict_line(sets: dict[str, dict]) -> str:
    """Which sets gained (the 90% interval of τ's change above 0), which lost (below), which did not move clearly."""
    parts = {"gained": [], "lost": [], "no clear change": []}
    for name, s in sets.items():
        t = s["tau"]
        lo, hi = t["interval"] or (-1, 1)  # one conversation tells no clear change
        key = "gained" if lo > 0 else "lost" if hi < 0 else "no clear change"
        parts[key].append(f"{name} {t['change']:+.2f} τ ({_pct(t['relative'])} {_interval(t['interval'])})")
    return "verdict: " + "; ".join(f"{k} {', '.join(v)}" for k, v in parts.items() if v)


def format_table(result: dict) -> str:
    """The printed comparison: one row per set, then the verdict line."""
    lines = [
        f"{result['before']} -> {result['after']}: greedy chain {result['setting']}, τ as a live decoder walks the "
        f"held-out answers; change with its {int(100 * LEVEL)}% interval over the conversations",
        f"{'set':<12} {'conv':>5} {'tokens':>7}  {'τ all tokens':<40}  {'τ loop-free tokens':<40}  break-even τ",
    ]
    for name, s in result["sets"].items():
        cells = []
        for which in ("tau", "tau_loop_free"):
            t = s[which]
            cells.append(f"{t['before']:.3f} -> {t['after']:.3f} {_pct(t['relative'])} {_interval(t['interval'])}")
        be = s.get("break_even")
        wins = be is not None and s["tau"]["after"] > be
        be_text = "no costs measured" if be is None else f"{be:.2f} (after: {'wins' if wins else 'loses'})"
        lines.append(f"{name:<12} {s['conversations']:>5} {s['tokens']:>7}  {cells[0]:<40}  {cells[1]:<40}  {be_text}")
    lines.append(result["verdict"])
    return "\n".join(lines)


def compare(
    before: dict[str, SetTotals], after: dict[str, SetTotals], labels: tuple[str, str], setting: str, costs: dict
) -> dict:
    """The comparison as data: per set change(), its break-even τ (the set's own, else the setting's), the verdict."""
    sets = {}
    for name in before:
        sets[name] = change(before[name], after[name])
        sets[name]["break_even"] = costs.get(name, costs.get(""))
    return {"before": labels[0], "after": labels[1], "setting": setting, "sets": sets, "verdict": verdict_line(sets)}


def drafter_walks(
    ev: EvalConfig, target: TargetConfig, harvest: HarvestConfig, run_dir: Path, folders: dict[str, DrafterFolder]
) -> dict[str, dict[str, SetTotals]]:
    """label -> held-out set -> the walk of that drafter folder on RUN's held-out features, each drafter in the
    target's dtype (every folder is checked against the features before any is loaded)."""
    from eagle3ft.targets.hf import load_input_embedding, pick_device  # transformers: off the --help path

    store = FeatureStore(RunDir(run_dir).features)
    for folder in folders.values():
        store.check_drafter(folder)
    ds = store.dataset("heldout")
    groups = heldout_sets(store, harvest)
    device = pick_device(target)
    emb = load_input_embedding(target)
    walks = {}
    for label, folder in folders.items():
        head = None
        if folder.family == "dflash":  # no embedding or head of its own: the target's
            from eagle3ft.targets.hf import load_output_head  # transformers: off the --help path

            head = (emb, load_output_head(target))
        drafter = folder.load_like(emb, device)
        with torch.no_grad():
            walks[label] = {
                name: measure(drafter, [ds[i] for i in idx], ev.steps, device, head) for name, idx in groups.items()
            }
    return walks


def run(cfg: Config, run_dir: Path, before: str | None = None, after: str | None = None) -> dict:
    """Both drafters' walks on every held-out set of RUN; the comparison (with each conversation's counts)."""

    if before is None and not cfg.drafter.init:
        raise ValueError("--before: no drafter to compare against (drafter.init is not set)")
    folders = {
        "--before": DrafterFolder(resolve_path(before or cfg.drafter.init), "--before"),
        "--after": DrafterFolder(resolve_path(after), "--after")
        if after
        else DrafterFolder.of_run(run_dir, cfg.eval.checkpoint, "--after"),
    }
    for label, folder in folders.items():
        if (folder.path / "trainer_state.json").is_file():
            raise ValueError(
                f"{label} {folder.path} is a training checkpoint (its state.safetensors holds the optimizer's state "
                "beside the weights), not a drafter folder: give an export (RUN/export, RUN/export-best)"
            )
    last = folders["--after"]
    block = last.config.block_size if last.family == "dflash" else None
    setting = f"{block - 1}/1/{block}" if block else f"{cfg.eval.steps}/1/{cfg.eval.steps + 1}"
    costs = break_even(run_dir, setting, cfg.eval.checkpoint)  # a damaged file is named before anything is measured
    walks = drafter_walks(cfg.eval, cfg.target, cfg.harvest, run_dir, folders)
    labels = (before or cfg.drafter.init, after or str(folders["--after"].path))  # as the user named them
    result = compare(walks["--before"], walks["--after"], labels, setting, costs)
    result["per_sample"] = {w.lstrip("-"): {n: t.per_sample for n, t in sets.items()} for w, sets in walks.items()}
    return result


def main(argv: list[str] | None = None) -> None:

    ap = build_parser("The drafter before and after a fine-tune, per held-out prompt set: τ, its change, a verdict.")
    ap.add_argument("--before", help="drafter folder before the fine-tune (default drafter.init)")
    ap.add_argument("--after", help="drafter folder after (default eval.checkpoint, relative to the run folder)")
    ap.add_argument("--out", type=Path, help="where the figures go (default RUN/eval/compare.json)")
    cfg, run_dir, args = parse_cli(ap.description, stage="compare", argv=argv, parser=ap)
    with cli_errors(command_name("compare.py"), StoreError, log=error_log(run_dir, "compare")):
        result = run(cfg, run_dir, args.before, args.after)
        out = args.out or RunDir(run_dir).eval / "compare.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, result, indent=1, newline=True)  # a full disk: one line naming the file
    print(format_table(result))


if __name__ == "__main__":
    main()
