"""The live bench's schedule: plain decoding against speculative decoding on the same prompts, whatever decodes them
(eval/bench/backend.py's interface; eval/bench/live.py picks the backend and sequences the stage).

Runs alternate A B A B (`bench.interleave`): per repetition, each prompt through the baseline and then every
`bench.settings` entry before the next prompt ("prompt"), or the baseline pass over all prompts and then one pass per
setting ("pass"); either way a repetition's results per arm make one pass. `bench.repetitions` repetitions after an
untimed warm-up (`bench.warmup`). Writes RUN/bench/runs.jsonl (one line per request and pass) and RUN/bench/summary.json
(eval/bench/summary.py: median and min-max tok/s per pass kind, tau, seconds per verify / draft forward / cycle, the
measured cost model, the environment).

Several drafters and prompt sets in one run (embedded backend): `bench.drafters` (label -> folder) are benched next to
`eval.checkpoint`, and each prompt set the caller loaded (data/render.py: `bench.prompts`, then
`bench.more_prompts`) in turn. Per repetition and prompt set: the baseline pass, then each drafter's pass per setting
(plain, A, B, plain, A, B, ...). summary.json's top level stays `eval.checkpoint` on the first set (what economics and
the report read); `prompt_sets` holds every set: its prompts and baseline, and per drafter its speculative rows, costs
and offline tau on the same prompts. Each runs.jsonl row names its `prompts` set and `drafter`.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from eagle3ft.config import BenchConfig, EvalConfig
from eagle3ft.data.render import PromptSet
from eagle3ft.eval.bench.backend import BenchBackend, RequestResult
from eagle3ft.eval.bench.summary import pass_tok_s, summarize
from eagle3ft.eval.runs import first_answers
from eagle3ft.files import json_text, write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.setting import Setting


def drafter_labels(ev: EvalConfig, bench: BenchConfig) -> list[str]:
    """`eval.checkpoint` as written (the summary's top level), then the labels of `bench.drafters`."""
    labels = [ev.checkpoint, *bench.drafters]
    if len(set(labels)) != len(labels):
        raise ValueError(f"bench.drafters: a label repeats or equals eval.checkpoint {ev.checkpoint!r}: {labels}")
    return labels


class _Arms:
    """The arms of one run, the baseline first: (drafter label, setting), (None, None) for plain decoding."""

    def __init__(self, ev: EvalConfig, bench: BenchConfig, backend: BenchBackend):
        self.labels = drafter_labels(ev, bench)
        if len(self.labels) > 1 and not hasattr(backend, "use_drafter"):
            raise ValueError(f"bench.drafters: the {backend.name} backend benches one drafter (eval.checkpoint)")
        self.backend, self.settings = backend, bench.settings
        self.all = [(None, None)] + [(d, s) for d in self.labels for s in self.settings]

    def use(self, drafter: str) -> None:
        if len(self.labels) > 1:
            self.backend.use_drafter(drafter)

    def run(self, d: str | None, s: Setting | None, prompts, max_new_tokens: int, first: int = 0):
        if s is None:
            return self.backend.run_baseline(prompts, max_new_tokens, first_index=first)
        self.use(d)
        return self.backend.run_speculative(prompts, s, max_new_tokens, first_index=first)


def run(
    ev: EvalConfig,
    bench: BenchConfig,
    run_dir: Path,
    backend: BenchBackend,
    sets: list[PromptSet],
    log: Callable[[str], None] = print,
) -> dict:
    """The benchmark on `backend` over the caller's prompt sets (the first is the summary's top level): warm-up,
    interleaved repetitions into RUN/bench/runs.jsonl, then RUN/bench/summary.json, which it returns."""
    bc = bench
    if bc.warmup not in ("all", "first"):
        raise ValueError(f"bench.warmup {bc.warmup!r}: expected all (every prompt once per arm) or first")
    if bc.interleave not in ("prompt", "pass"):
        raise ValueError(f"bench.interleave {bc.interleave!r}: expected prompt (every arm per prompt) or pass")
    arms = _Arms(ev, bench, backend)
    RunDir(run_dir).bench.mkdir(parents=True, exist_ok=True)
    log(
        f"bench: {backend.name}, {' + '.join(f'{len(p.prompts)} {p.label}' for p in sets)} prompts, "
        f"{bc.max_new_tokens} new tokens, {bc.repetitions} repetitions, settings {[s.key for s in bc.settings]}"
        + (f", drafters {arms.labels}" if len(arms.labels) > 1 else "")
    )
    # warm-up, untimed, requests as long as the timed ones: every prompt of every set per arm, or the first one
    warm = [p for ps in sets for p in ps.prompts] if bc.warmup == "all" else sets[0].prompts[:1]
    for d, s in arms.all:
        arms.run(d, s, warm, bc.max_new_tokens)
    runs = _repetitions(bench, run_dir, arms, sets, log)
    summary = _summary(ev, bench, backend, arms, sets, runs)
    write_json(RunDir(run_dir).bench_summary, summary, indent=2)
    return summary


def _repetitions(
    bench: BenchConfig, run_dir: Path, arms: _Arms, sets: list[PromptSet], log: Callable[[str], None]
) -> list[dict]:
    """The timed repetitions, every arm per prompt (bench.interleave prompt) or per pass; each request a row of
    RUN/bench/runs.jsonl, written as it comes and renamed into place at the end."""
    bc, paths = bench, RunDir(run_dir)
    tmp = paths.bench / "runs.jsonl.tmp"
    runs: list[dict] = []
    tmp.unlink(missing_ok=True)
    with open(tmp, "x") as f:  # created fresh (O_EXCL): never written through a link

        def record(rep: int, mode: str, key: str | None, pset: str, drafter: str | None, results) -> None:
            for r in results:
                row = {"repetition": rep, "mode": mode, "setting": key, "prompts": pset, "drafter": drafter}
                row.update({**asdict(r), "tok_s": r.tok_s})
                runs.append(row)
                f.write(json_text(row, str(paths.bench_runs)) + "\n")
            f.flush()
            who = f"{pset} " * (len(sets) > 1) + f"{drafter} " * (len(arms.labels) > 1 and drafter is not None)
            log(f"  rep {rep} {mode:<11} {key or '':<8} {who}{pass_tok_s(results):8.1f} tok/s")

        for rep in range(bc.repetitions):
            for ps in sets:
                step = 1 if bc.interleave == "prompt" else len(ps.prompts)
                got: list[list[RequestResult]] = [[] for _ in arms.all]
                for first in range(0, len(ps.prompts), step):
                    chunk = ps.prompts[first : first + step]
                    for k, (d, s) in enumerate(arms.all):
                        got[k] += arms.run(d, s, chunk, bc.max_new_tokens, first)
                for (d, s), results in zip(arms.all, got):
                    mode, key = ("baseline", None) if s is None else ("speculative", s.key)
                    record(rep, mode, key, ps.label, d, results)
    os.replace(tmp, paths.bench_runs)
    return runs


def _summary(
    ev: EvalConfig, bench: BenchConfig, backend: BenchBackend, arms: _Arms, sets: list[PromptSet], runs: list[dict]
) -> dict:
    """summary.json: per prompt set its baseline and per drafter its rows, costs and offline tau on the same prompts;
    the top level is eval.checkpoint on the first set."""
    bc, settings = bench, bench.settings
    curve = None
    if hasattr(backend, "verify_costs"):
        sizes = sorted({1, *range(2, max(s.num_draft_tokens for s in settings) + 3)})
        curve = backend.verify_costs(sets[0].prompts[0], sizes)
    by_set = {}
    for ps in sets:
        same = {}
        if hasattr(backend, "offline_tau") and bc.temperature == 0:  # offline tau on the tokens the live runs decoded
            answers = first_answers(runs, ps.label)
            for d in arms.labels:
                arms.use(d)
                same[d] = backend.offline_tau(ps.prompts, [answers[i] for i in range(len(ps.prompts))], settings)
        drafters = {}
        for d in arms.labels:
            rows = [r for r in runs if r["prompts"] == ps.label and r["drafter"] in (None, d)]
            s = summarize(rows, settings, curve)
            drafters[d] = {
                "checkpoint": ev.checkpoint if d == arms.labels[0] else bc.drafters[d],
                "speculative": s["speculative"],
                "costs": s["costs"],
                "offline_same_prompts": same.get(d),
            }
        by_set[ps.label] = {
            "source": asdict(ps.source),
            "count": len(ps.prompts),
            "tokens": [len(p) for p in ps.prompts],
            "baseline": s["baseline"],
            "drafters": drafters,
        }
    top = by_set[sets[0].label]
    mine = top["drafters"][arms.labels[0]]
    return {
        "backend": backend.name,
        "environment": backend.environment(),
        "prompts": {"source": top["source"], "count": top["count"], "tokens": top["tokens"]},
        "max_new_tokens": bc.max_new_tokens,
        "repetitions": bc.repetitions,
        "interleave": bc.interleave,
        "temperature": bc.temperature,
        "baseline": top["baseline"],
        "speculative": mine["speculative"],
        "costs": mine["costs"],
        "offline_same_prompts": mine["offline_same_prompts"],
        "prompt_sets": by_set,
    }
