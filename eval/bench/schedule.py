"""The live benchmark's harness: plain decoding against speculative decoding on the same prompts,
whatever decodes them. eval/bench/live.py picks the backend; eval/bench/embedded_backend.py and eval/bench/sglang_backend.py
are the two backends.

Prompts come from `bench.prompts` (MT-Bench by default): the first user turn, rendered with the
target's chat template into token ids once, so every backend decodes exactly the same tokens.
Runs alternate A B A B (`bench.interleave`): per repetition, each prompt through the baseline and then every
`bench.settings` entry before the next prompt ("prompt"), or the baseline pass over all prompts and then one pass per
setting ("pass"); either way a repetition's results per arm make one pass. `bench.repetitions` repetitions after an
untimed warm-up (`bench.warmup`). Writes
RUN/bench/runs.jsonl (one line per request and pass), RUN/bench/summary.json (median and
min-max tok/s per pass kind, tau, seconds per verify / draft forward / cycle, the measured cost
model, the environment), RUN/bench/economics.json (eval/economics/analysis.py on the summary) and
RUN/bench/calibration.json (these costs, for predicting a later drafter's tok/s: bench.calibration).

Several drafters and prompt sets in one run (embedded backend): `bench.drafters` (label -> folder) are
benched next to `eval.checkpoint`, and `bench.more_prompts` next to `bench.prompts`. Per repetition and
prompt set: the baseline pass, then each drafter's pass per setting (plain, A, B, plain, A, B, ...).
summary.json's top level stays `eval.checkpoint` on `bench.prompts` (what economics and the report
read); `prompt_sets` holds every set: its prompts and baseline, and per drafter its speculative rows,
costs and offline tau on the same prompts. Each runs.jsonl row names its `prompts` set and `drafter`.

Backends sit behind a narrow interface:

    class BenchBackend(Protocol):
        name: str
        def run_baseline(self, prompts: list[list[int]], max_new_tokens: int, first_index: int = 0)
            -> list[RequestResult]
        def run_speculative(
            self, prompts: list[list[int]], setting: Setting, max_new_tokens: int, first_index: int = 0
        ) -> list[RequestResult]
        def environment(self) -> dict
    optional:
        def verify_costs(self, prompt: list[int], sizes: list[int]) -> dict[int, float]
            seconds of one target forward of n tokens after `prompt` (the economics' verify curve)
        def offline_tau(self, prompts, answers, settings) -> dict | None
            the drafter's offline tau on the prompts and the plain pass's answers (summary's
            offline_same_prompts: offline and live tau on the same tokens; greedy benches only)

`prompts` are token ids (chat template applied, generation prompt included), prompts[k] being prompt number
first_index + k of the set (its RequestResult's prompt_index); decoding follows
`bench.temperature` and stops at the template's end-of-turn/eos ids or at max_new_tokens. A
RequestResult's decode_s is the time after the first new token until the last one, so tok/s =
(new_tokens - 1) / decode_s for both kinds of pass; speculative results carry the verify count and
the tokens emitted per verify (bonus included, SGLang's spec_accept_length); timings per verify /
draft forward / cycle where the backend can see them (None otherwise).
"""

from __future__ import annotations

import os
import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from eagle3ft.eval.bench.environment import base_environment, cpu_model, gpu_clocks  # noqa: F401 (the backends')
from eagle3ft.eval.bench.format import format_summary  # noqa: F401 (the entry points print it)
from eagle3ft.eval.bench.live_splits import arm_figures
from eagle3ft.eval.economics import analysis
from eagle3ft.eval.economics.analysis import format_table
from eagle3ft.files import json_text, write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.setting import Setting


@dataclass
class RequestResult:
    prompt_index: int
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float  # after the first new token until the last
    output_ids: list[int] | None = None
    verify_count: int | None = None
    accept_lengths: list[int] | None = None  # tokens emitted per verify, bonus included
    verify_s: list[float] | None = None
    draft_forward_s: list[float] | None = None
    cycle_s: list[float] | None = None
    wall_s: float | None = None  # the request sent -> its answer complete: prefill and transport included
    finished: bool | None = None  # stopped on a stop id before max_new_tokens
    events: list[list[float]] | None = None  # streamed: [seconds after the first token, tokens so far] per event
    whole: dict | None = None  # sglang: the same prompt's non-streamed request: new_tokens, wall_s, output_ids, ...

    @property
    def tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0


@runtime_checkable
class BenchBackend(Protocol):
    name: str

    def run_baseline(
        self, prompts: list[list[int]], max_new_tokens: int, first_index: int = 0
    ) -> list[RequestResult]: ...

    def run_speculative(
        self, prompts: list[list[int]], setting: Setting, max_new_tokens: int, first_index: int = 0
    ) -> list[RequestResult]: ...

    def environment(self) -> dict: ...


# --------------------------------------------------------------------------- the drafter both backends load


def check_drafter_for_run(folder: Path, run_dir: Path, where: str):
    """check_drafter_folder against the run's features when they exist (the drafter must fit what it was trained on),
    else the folder alone (readable finite weights, consistent d2t/t2d), and the weights' shapes against its config.json;
    returns its DrafterConfig. Before any compute."""
    from eagle3ft.data.store import FeatureStore
    from eagle3ft.drafter.config import DrafterConfig, check_drafter_folder, check_weights_finite
    from eagle3ft.drafter.export import check_weight_shapes
    from eagle3ft.drafter.vocab import check_vocab, vocab_from_drafter

    manifest = RunDir(run_dir).features_manifest
    if manifest.is_file():
        spec = check_drafter_folder(folder, FeatureStore(manifest.parent, verify=False).target, where, str(manifest))
    else:
        if not (Path(folder) / "config.json").is_file():
            raise FileNotFoundError(f"{where}: {folder} has no config.json (expected a drafter in SGLang's form)")
        spec = DrafterConfig.from_json(Path(folder) / "config.json")
        check_vocab(
            *vocab_from_drafter(folder), spec.vocab_size, spec.draft_vocab_size, f"{where} {folder}: draft vocabulary"
        )
        check_weights_finite(folder, where)
    check_weight_shapes(folder, spec)
    return spec


def drafter_on_target(model, folder: Path, spec):
    """(the drafter of `folder` on `model`: its embedding, device and dtype; its aux layer ids, checked against the
    target's dimensions). `spec` is the folder's DrafterConfig, from check_drafter_for_run."""
    from eagle3ft.drafter.export import load_drafter

    c, emb = model.config, model.get_input_embeddings().weight.detach()
    aux_ids = spec.check_target(c.hidden_size, c.vocab_size, c.num_hidden_layers)
    return load_drafter(folder, embedding=emb.float()).to(device=emb.device, dtype=emb.dtype).eval(), aux_ids


# --------------------------------------------------------------------------- harness


def load_prompts(cfg, source=None) -> list[list[int]]:
    """First user turn of each conversation of `source` (default `bench.prompts`), chat-templated into token ids."""
    from eagle3ft.data.chat import ChatFormat
    from eagle3ft.data.prompts import collect
    from eagle3ft.targets.hf import load_tokenizer

    source = source or cfg.bench.prompts
    convs = collect([source], max_turns=1, regenerate=True, heldout_fraction=0.0, dedupe=True, skips=Counter())
    chat = ChatFormat(load_tokenizer(cfg.target), cfg.target.chat_template)
    out = []
    for c in convs:
        first_user = next(i for i, m in enumerate(c.messages) if m["role"] == "user")
        ids, _ = chat.encode(c.messages[: first_user + 1], add_generation_prompt=True)
        out.append(ids)
    if not out:
        raise ValueError(f"bench prompts {source} gave no prompts")
    return out


def prompt_sets(cfg) -> list[tuple[str, object]]:
    """(label, source) of `bench.prompts`, then of each `bench.more_prompts`, labelled by kind (a repeated kind
    numbered)."""
    out: list[tuple[str, object]] = []
    for src in [cfg.bench.prompts, *cfg.bench.more_prompts]:
        label, n = src.kind, 2
        while label in dict(out):
            label, n = f"{src.kind}-{n}", n + 1
        out.append((label, src))
    return out


def drafter_labels(cfg) -> list[str]:
    """`eval.checkpoint` as written (the summary's top level), then the labels of `bench.drafters`."""
    labels = [cfg.eval.checkpoint, *cfg.bench.drafters]
    if len(set(labels)) != len(labels):
        raise ValueError(f"bench.drafters: a label repeats or equals eval.checkpoint {cfg.eval.checkpoint!r}: {labels}")
    return labels


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "per_repetition": xs}


def _median(xs: list[float]) -> float | None:
    """Per-cycle times have a long tail (a collection pause, a clock ramp): the median is what a cycle costs."""
    return statistics.median(xs) if xs else None


def _pass_tok_s(results: list[RequestResult]) -> float:
    """Decode tok/s of one pass over the prompts: all decoded tokens over all decode time."""
    return sum(r.new_tokens - 1 for r in results) / sum(r.decode_s for r in results)


def first_answers(runs: list[dict], pset: str, setting: str | None = None) -> dict[int, list[int]]:
    """Prompt index -> output ids of the first repetition of prompt set `pset` in a bench's raw runs (runs.jsonl's
    rows): the plain pass's, or with `setting` (a key such as "3/1/4") the speculative pass's."""
    mode = "baseline" if setting is None else "speculative"
    return {
        r["prompt_index"]: r["output_ids"]
        for r in runs
        if r["mode"] == mode and r["setting"] == setting and r["repetition"] == 0 and r["prompts"] == pset
    }


def summarize(runs: list[dict], settings: list[Setting], verify_curve: dict[int, float] | None) -> dict:
    """Aggregate raw runs (dicts of RequestResult fields plus mode/setting/repetition)."""

    def passes(mode: str, key: str | None) -> dict[int, list[RequestResult]]:
        by: dict[int, list[RequestResult]] = {}
        for r in runs:
            if r["mode"] == mode and r["setting"] == key:
                by.setdefault(r["repetition"], []).append(
                    RequestResult(**{k: r[k] for k in RequestResult.__dataclass_fields__ if k in r})
                )
        return by

    base = passes("baseline", None)
    base_rows = [r for r in runs if r["mode"] == "baseline" and r["setting"] is None]
    base_by_rep = {rep: _pass_tok_s(v) for rep, v in sorted(base.items())}
    base_tok_s = list(base_by_rep.values())
    base_s_per_token = statistics.median(1 / t for t in base_tok_s)
    baseline_outputs = {(r.prompt_index): r.output_ids for v in base.values() for r in v}
    spec_rows, draft_fwd, overheads, run_verify = [], [], [], {}
    for st in settings:
        sp = passes("speculative", st.key)
        if not sp:
            continue
        allr = [r for v in sp.values() for r in v]
        acc = [a for r in allr for a in (r.accept_lengths or [])]
        verifies = sum(r.verify_count or 0 for r in allr)
        by_rep = {rep: _pass_tok_s(v) for rep, v in sorted(sp.items())}
        tok_s = list(by_rep.values())
        paired = [t / base_by_rep[rep] for rep, t in by_rep.items() if rep in base_by_rep]
        cycles = {  # per repetition: decode time / verifies, the mean cycle
            rep: sum(r.decode_s for r in v) / sum(r.verify_count or 0 for r in v)
            for rep, v in sorted(sp.items())
            if any(r.verify_count for r in v)
        }
        per_pass = list(cycles.values())
        cycle_steps = [c * base_by_rep[rep] for rep, c in cycles.items() if rep in base_by_rep]  # cycle / plain step
        verify_s = [t for r in allr for t in (r.verify_s or [])]
        draft_s = [t for r in allr for t in (r.draft_forward_s or [])]
        cycle_s = [t for r in allr for t in (r.cycle_s or [])]
        row = {
            "setting": asdict(st),
            "key": st.key,
            "tok_s": spread(tok_s),
            "tok_s_median": statistics.median(tok_s),
            "speedup_median": statistics.median(tok_s) / statistics.median(base_tok_s),
            # per repetition, this pass's tok/s over the same repetition's plain pass: with bench.interleave prompt
            # the two ran over the same seconds, so a slow spell of the host slows both
            "speedup_paired": spread(paired) if paired else None,
            "tau": sum(acc) / verifies if verifies else None,
            "verify_count": verifies,
            "accept_histogram": {str(k): v for k, v in sorted(Counter(acc).items())},
            "verify_ms": 1e3 * _median(verify_s) if verify_s else None,
            "draft_forward_ms": 1e3 * _median(draft_s) if draft_s else None,
            "cycle_s": _median(cycle_s) if cycle_s else _median(per_pass),  # else: decode time / verifies, per pass
            "cycle_s_per_pass": _median(
                per_pass
            ),  # decode time / verifies: the mean cycle, what tok/s = tau / cycle holds for
            # that mean cycle over the same repetition's plain seconds per token, median over repetitions
            "cycle_plain_steps": _median(cycle_steps),
            "figures": arm_figures(
                [r for r in runs if r["mode"] == "speculative" and r["setting"] == st.key], base_rows
            ),
            "outputs_match_baseline": sum(r.output_ids == baseline_outputs.get(r.prompt_index) for r in allr)
            / len(allr)
            if all(r.output_ids is not None for r in allr)
            else None,
        }
        spec_rows.append(row)
        if draft_s:
            draft_fwd += draft_s
        if verify_s:
            run_verify.setdefault(st.num_draft_tokens, []).extend(verify_s)
        if cycle_s and verify_s and draft_s:
            overheads.append(_median(cycle_s) - _median(verify_s) - st.steps * _median(draft_s))
    if verify_curve or run_verify:
        verify_costs = {**(verify_curve or {}), **{n: _median(v) for n, v in run_verify.items()}}
        source = "verify forwards timed inside the benchmark runs, other sizes from backend.verify_costs"
        draft_forward_s = _median(draft_fwd) or 0.0
        overhead_s = max(0.0, _median(overheads) or 0.0)
    else:
        verify_costs = {r["setting"]["num_draft_tokens"]: r["cycle_s"] for r in spec_rows if r["cycle_s"]}
        source = (
            "whole draft+verify cycle per setting (decode time / verify count, median over passes): draft cost "
            "folded into verify"
        )
        draft_forward_s, overhead_s = 0.0, 0.0
    return {
        "baseline": {
            "tok_s": spread(base_tok_s),
            "tok_s_median": statistics.median(base_tok_s),
            "ms_per_token": 1e3 * base_s_per_token,
            "figures": arm_figures(base_rows, None),
        },
        "speculative": spec_rows,
        "costs": {
            "baseline_s_per_token": base_s_per_token,
            "verify_s": {str(k): v for k, v in sorted(verify_costs.items())},
            "draft_forward_s": draft_forward_s,
            "overhead_s": overhead_s,
            "source": source,
        },
    }


def run(cfg, run_dir: Path, backend: BenchBackend, log=print) -> dict:
    """The benchmark on `backend`: warm-up, interleaved repetitions, summary, economics."""
    bc = cfg.bench
    settings = bc.settings
    labels = drafter_labels(cfg)
    if len(labels) > 1 and not hasattr(backend, "use_drafter"):
        raise ValueError(f"bench.drafters: the {backend.name} backend benches one drafter (eval.checkpoint)")
    sets = [(label, src, load_prompts(cfg, src)) for label, src in prompt_sets(cfg)]
    primary_set, primary_drafter = sets[0][0], labels[0]
    paths = RunDir(run_dir)
    out = paths.bench
    out.mkdir(parents=True, exist_ok=True)
    log(
        f"bench: {backend.name}, {' + '.join(f'{len(p)} {label}' for label, _, p in sets)} prompts, "
        f"{bc.max_new_tokens} new tokens, {bc.repetitions} repetitions, settings {[s.key for s in settings]}"
        + (f", drafters {labels}" if len(labels) > 1 else "")
    )

    def speculative(prompts, s: Setting, drafter: str, max_new_tokens: int, first: int = 0) -> list[RequestResult]:
        if len(labels) > 1:
            backend.use_drafter(drafter)
        return backend.run_speculative(prompts, s, max_new_tokens, first_index=first)

    if bc.warmup not in ("all", "first"):
        raise ValueError(f"bench.warmup {bc.warmup!r}: expected all (every prompt once per arm) or first")
    if bc.interleave not in ("prompt", "pass"):
        raise ValueError(f"bench.interleave {bc.interleave!r}: expected prompt (every arm per prompt) or pass")
    arms = [(None, None)] + [(d, s) for d in labels for s in settings]  # (drafter, setting); the baseline first
    # warm-up, untimed, requests as long as the timed ones: every prompt of every set per arm, or the first one
    warm = [p for _, _, prompts in sets for p in prompts] if bc.warmup == "all" else sets[0][2][:1]
    backend.run_baseline(warm, bc.max_new_tokens)
    for d in labels:
        for s in settings:
            speculative(warm, s, d, bc.max_new_tokens)
    runs: list[dict] = []
    (out / "runs.jsonl.tmp").unlink(missing_ok=True)
    with open(out / "runs.jsonl.tmp", "x") as f:  # created fresh (O_EXCL): never written through a link

        def record(rep: int, mode: str, key: str | None, pset: str, drafter: str | None, results) -> None:
            for r in results:
                row = {"repetition": rep, "mode": mode, "setting": key, "prompts": pset, "drafter": drafter}
                row.update({**asdict(r), "tok_s": r.tok_s})
                runs.append(row)
                f.write(json_text(row, str(paths.bench_runs)) + "\n")
            f.flush()
            who = f"{pset} " * (len(sets) > 1) + f"{drafter} " * (len(labels) > 1 and drafter is not None)
            log(f"  rep {rep} {mode:<11} {key or '':<8} {who}{_pass_tok_s(results):8.1f} tok/s")

        for rep in range(bc.repetitions):
            for pset, _, prompts in sets:
                step = 1 if bc.interleave == "prompt" else len(prompts)
                got: list[list[RequestResult]] = [[] for _ in arms]
                for first in range(0, len(prompts), step):
                    chunk = prompts[first : first + step]
                    for k, (d, s) in enumerate(arms):
                        if s is None:
                            got[k] += backend.run_baseline(chunk, bc.max_new_tokens, first_index=first)
                        else:
                            got[k] += speculative(chunk, s, d, bc.max_new_tokens, first)
                for (d, s), results in zip(arms, got):
                    mode, key = ("baseline", None) if s is None else ("speculative", s.key)
                    record(rep, mode, key, pset, d, results)
    os.replace(out / "runs.jsonl.tmp", paths.bench_runs)
    curve = None
    if hasattr(backend, "verify_costs"):
        sizes = sorted({1, *range(2, max(s.num_draft_tokens for s in settings) + 3)})
        curve = backend.verify_costs(sets[0][2][0], sizes)
    by_set = {}
    for pset, src, prompts in sets:
        same = {}
        if hasattr(backend, "offline_tau") and bc.temperature == 0:  # offline tau on the tokens the live runs decoded
            answers = first_answers(runs, pset)
            for d in labels:
                if len(labels) > 1:
                    backend.use_drafter(d)
                same[d] = backend.offline_tau(prompts, [answers[i] for i in range(len(prompts))], settings)
        drafters = {}
        for d in labels:
            rows = [r for r in runs if r["prompts"] == pset and r["drafter"] in (None, d)]
            s = summarize(rows, settings, curve)
            drafters[d] = {
                "checkpoint": cfg.eval.checkpoint if d == primary_drafter else bc.drafters[d],
                "speculative": s["speculative"],
                "costs": s["costs"],
                "offline_same_prompts": same.get(d),
            }
        by_set[pset] = {
            "source": asdict(src),
            "count": len(prompts),
            "tokens": [len(p) for p in prompts],
            "baseline": s["baseline"],
            "drafters": drafters,
        }
    top = by_set[primary_set]
    summary = {
        "backend": backend.name,
        "environment": backend.environment(),
        "prompts": {"source": top["source"], "count": top["count"], "tokens": top["tokens"]},
        "max_new_tokens": bc.max_new_tokens,
        "repetitions": bc.repetitions,
        "interleave": bc.interleave,
        "temperature": bc.temperature,
        "baseline": top["baseline"],
        "speculative": top["drafters"][primary_drafter]["speculative"],
        "costs": top["drafters"][primary_drafter]["costs"],
        "offline_same_prompts": top["drafters"][primary_drafter]["offline_same_prompts"],
        "prompt_sets": by_set,
    }
    write_json(paths.bench_summary, summary, indent=2)
    ec, _ = analysis.run(run_dir, cfg)  # economics.json, calibration.json, and the prediction with bench.calibration
    log(format_table(ec))
    return summary
