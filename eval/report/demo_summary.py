"""The demo's story in numbers: a shipped drafter before and after a fine-tune on one domain.

    python eval/report/demo_summary.py measure  --config CFG --run-dir RUN   # offline per held-out set + the live bench
    python eval/report/demo_summary.py offline  --config CFG --run-dir RUN [--only LABEL ...]
    python eval/report/demo_summary.py headline --config CFG --run-dir RUN [--before LABEL] [--after LABEL]

The drafters are the bench's: `eval.checkpoint` (the run's fine-tuned export, labelled as written, e.g.
"export") and each `bench.drafters` label (e.g. "shipped": the folder the run warm-started from).

`measure` does both of the following in one process, with one load of the target: `offline`, then the
live bench (eval/bench/schedule.py on the embedded backend) with the drafters already loaded.

`offline` measures each drafter's offline tau on RUN's held-out features, one figure per held-out
source (HumanEval apart from MT-Bench: the source each sample was harvested from, data/sources.py sample_sources), and
writes RUN/demo/offline-<label>.json. Each drafter runs in the target's dtype, as the bench runs it.

`headline` joins those files with RUN/bench/summary.json (plain decoding and both drafters timed in one
interleaved run, on every prompt set) and the training record. It prints before -> after for tau
(offline and live) and tok/s against plain decoding, on the domain (the kind of `bench.prompts`) and on
the general prompts (every other kind), each with the prompts and tokens behind it, and writes
RUN/demo/summary.json and RUN/demo/summary.md.

Speculation beats plain decoding when tau exceeds the break-even tau, cycle time / plain step time
(eval/economics/analysis.py): the headline prints it per prompt set beside the taus.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3ft.cli import build_parser, cli_errors, command_name, error_log, parse_cli
from eagle3ft.config import BenchConfig, Config
from eagle3ft.config_train import TrainConfig
from eagle3ft.data.store import StoreError
from eagle3ft.eval.bench.measure import run_measure, run_offline
from eagle3ft.eval.preflight import check_or_exit
from eagle3ft.files import write_atomic, write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.runlock import holding

# --------------------------------------------------------------------------- headline


def _pct(a: float | None, b: float | None) -> str:
    return f"{100 * (b - a) / a:+.0f}%" if a and b is not None else "n/a"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _training(run_dir: Path) -> dict:
    """What the fine-tune did: steps, seconds, the train split it saw, the held-out tau the trainer measured."""
    out: dict = {}
    metrics = RunDir(run_dir).metrics
    if metrics.is_file():
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        steps = [r for r in rows if "step" in r and "loss" in r]
        if steps:
            out["steps"] = steps[-1]["step"]
            out["train_s"] = round(sum(r.get("s_per_step", 0.0) for r in steps), 1)
    manifest = RunDir(run_dir).features_manifest
    if manifest.is_file():
        counts = json.loads(manifest.read_text()).get("counts", {})
        out["train_split"] = counts.get("train")
        out["heldout_split"] = counts.get("heldout")
    card = RunDir(run_dir).export / "card.json"
    if card.is_file():
        out["export_card"] = json.loads(card.read_text())
    l2sp = metrics.parent / "l2sp.json"  # train.l2sp auto: the λ the run set, and why
    if l2sp.is_file():
        out["l2sp_self_set"] = json.loads(l2sp.read_text())
    data = metrics.parent / "data.json"
    if data.is_file():
        trained = json.loads(data.read_text())
        out["sources"] = trained.get("sources")  # each source's weight and share of the draws
        if "samples" in trained:  # what was trained on: without the samples the guard set aside
            out["train_split"] = {"samples": trained["samples"], "loss_tokens": trained.get("answer_tokens")}
    return out


def build(bench: BenchConfig, train: TrainConfig, run_dir: Path, before: str, after: str) -> dict:
    """The before/after table as data: per prompt set (domain first) offline tau, live tau, tok/s and break-even."""
    summary_path = RunDir(run_dir).bench_summary
    measured = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    offline = {}
    for label in (before, after):
        p = RunDir(run_dir).demo / f"offline-{label}.json"
        offline[label] = json.loads(p.read_text()) if p.is_file() else None
    domain = bench.prompts.kind
    setting = bench.settings[-1].key  # the deepest benchmarked setting
    seen = {k for o in offline.values() if o for k in o["sets"]} | set((measured or {}).get("prompt_sets", {}))
    kinds = [domain] + sorted(seen - {domain})
    sets = []
    for kind in kinds:
        row: dict = {"kind": kind, "role": "domain" if kind == domain else "general", "setting": setting}
        off = {k: (o["sets"].get(kind) if o else None) for k, o in offline.items()}
        if any(off.values()):
            ref = next(v for v in off.values() if v)
            row["offline"] = {
                "conversations": ref["conversations"],
                "answer_tokens": ref["answer_tokens"],
                "roots": ref["roots"],
                "before": off[before]["settings"].get(setting) if off[before] else None,
                "after": off[after]["settings"].get(setting) if off[after] else None,
            }
        pset = (measured or {}).get("prompt_sets", {}).get(kind)
        if pset:
            base = pset["baseline"]
            live = {"prompts": pset["count"], "prompt_tokens": sum(pset["tokens"]), "plain_tok_s": base["tok_s_median"]}
            live["plain_ms_per_token"] = base["ms_per_token"]
            live["max_new_tokens"], live["repetitions"] = measured["max_new_tokens"], measured["repetitions"]
            for which, label in (("before", before), ("after", after)):
                d = pset["drafters"].get(label)
                r = next((x for x in (d or {}).get("speculative", []) if x["key"] == setting), None)
                if r is None:
                    live[which] = None
                    continue
                cycle = r["cycle_s_per_pass"] or r["cycle_s"]
                live[which] = {
                    "tau": r["tau"],
                    "verifies": r["verify_count"],
                    "tokens": round(r["tau"] * r["verify_count"]) if r["tau"] else None,
                    "tok_s": r["tok_s_median"],
                    "speedup": r["speedup_median"],
                    "cycle_ms": 1e3 * cycle if cycle else None,
                    "break_even_tau": cycle / (base["ms_per_token"] / 1e3) if cycle else None,
                    "outputs_match_plain": r["outputs_match_baseline"],
                    "offline_same_prompts": ((d.get("offline_same_prompts") or {}).get("settings") or {}).get(setting),
                }
            row["live"] = live
        sets.append(row)
    return {
        "before": before,
        "after": after,
        "setting": setting,
        "domain": domain,
        "training": {**_training(run_dir), "l2sp": train.objective.l2sp},
        "sets": sets,
        "environment": (measured or {}).get("environment"),
    }


def format_headline(h: dict) -> str:
    """The printed headline: one block per prompt set, before -> after, with what each figure was measured on."""
    t = h["training"]
    tr = t.get("train_split") or {}
    card = t.get("export_card") or {}
    lines = [
        f"== {h['before']} drafter -> fine-tuned on {h['domain']} ({t.get('steps', '?')} steps, "
        f"{_f(t.get('train_s'), '.0f')} s; {tr.get('samples', '?')} conversations, {tr.get('loss_tokens', '?')} answer "
        f"tokens), setting {h['setting']} (steps/topk/draft tokens)"
    ]
    mix = t.get("sources") or {}
    auto = t.get("l2sp_self_set")
    if auto:
        recipe = [
            f"L2-SP toward the {h['before']} weights (λ {auto['lambda']:.3g}, set by the run after step {auto['step']})"
        ]
    else:
        recipe = (
            [f"L2-SP toward the {h['before']} weights (λ {t['l2sp']:g})"] if t.get("l2sp") not in (0, "auto") else []
        )
    if len(mix) > 1:
        shares = ", ".join(f"{n} {m['share']:.0%}" for n, m in mix.items())
        recipe.append(f"answer tokens drawn per source: {shares}")
    if recipe:
        lines.append("recipe: " + "; ".join(recipe))
    if card.get("guard"):
        lines.append(f"export chosen by the guard: {card['guard']['why']}")
    for s in h["sets"]:
        lines.append(f"{s['role']} ({s['kind']}):")
        off = s.get("offline")
        if off:
            lines.append(
                f"  tau offline   {_f(off['before'])} -> {_f(off['after'])} ({_pct(off['before'], off['after'])})"
                f"   held out: {off['conversations']} conversations, {off['answer_tokens']} answer tokens"
            )
        live = s.get("live")
        if live:
            b, a = live.get("before"), live.get("after")
            if b and a:
                lines.append(
                    f"  tau live      {_f(b['tau'])} -> {_f(a['tau'])} ({_pct(b['tau'], a['tau'])})"
                    f"   {b['tokens']} tokens accepted in {b['verifies']} verifies -> {a['tokens']} in {a['verifies']}"
                )
                lines.append(
                    f"  tok/s         {b['tok_s']:.1f} (x{b['speedup']:.2f}) -> {a['tok_s']:.1f} (x{a['speedup']:.2f})"
                    f" against plain {live['plain_tok_s']:.1f}   {live['prompts']} prompts"
                    f" ({live['prompt_tokens']} prompt tokens), {live['max_new_tokens']} new tokens each,"
                    f" {live['repetitions']} interleaved repetitions"
                )
                lines.append(
                    f"  break-even    tau {_f(a['break_even_tau'])} (cycle {_f(a['cycle_ms'], '.1f')} ms"
                    f" over a plain step {live['plain_ms_per_token']:.1f} ms): "
                    + (
                        "above it, speculation wins"
                        if a["tau"] >= (a["break_even_tau"] or 0)
                        else "below it, speculation loses"
                    )
                )
    if card.get("heldout_tau") is not None:
        sets = card.get("heldout_sets") or {}
        per_set = ", ".join(f"{n} {v['tau']:.3f}" for n, v in sets.items()) if len(sets) > 1 else ""
        lines.append(
            f"trainer's held-out tau at the export (depth {card.get('heldout_depth')}, all held-out sets): "
            f"{card['heldout_tau']:.3f}" + (f" ({per_set})" if per_set else "")
        )
    return "\n".join(lines)


def run_headline(cfg: Config, run_dir: Path, before: str | None = None, after: str | None = None) -> dict:
    labels = [cfg.eval.checkpoint, *cfg.bench.drafters]
    before = before or (labels[1] if len(labels) > 1 else labels[0])
    after = after or cfg.eval.checkpoint
    h = build(cfg.bench, cfg.train, run_dir, before, after)
    text = format_headline(h)
    out = RunDir(run_dir).demo
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "summary.json", {**h, "headline": text}, indent=2, newline=True)
    write_atomic(out / "summary.md", "# Demo: before and after the fine-tune\n\n```\n" + text + "\n```\n")
    return {**h, "headline": text}


def main(argv: list[str] | None = None) -> None:
    prog = command_name("demo_summary.py")  # in errors: the command the user typed

    ap = build_parser("The demo's before/after: offline tau per held-out set, then the headline.")
    ap.add_argument("command", choices=("offline", "measure", "headline"))
    ap.add_argument("--only", action="append", default=[], help="offline: this drafter label only (repeatable)")
    ap.add_argument("--before", help="headline: the drafter before the fine-tune (default: the first bench.drafters)")
    ap.add_argument("--after", help="headline: the drafter after (default: eval.checkpoint)")
    cfg, run_dir, args = parse_cli(ap.description, stage="demo", argv=argv, parser=ap)
    if args.command == "measure":
        check_or_exit(prog, "bench", cfg, run_dir, args.config)

    with (
        holding(run_dir, "demo", prog),
        cli_errors(prog, StoreError, log=error_log(run_dir, "demo")),
    ):
        if args.command == "offline":
            run_offline(cfg, run_dir, args.only or None)
        elif args.command == "measure":
            run_measure(cfg, run_dir)
        else:
            print(run_headline(cfg, run_dir, args.before, args.after)["headline"])


if __name__ == "__main__":
    main()
