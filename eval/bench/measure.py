"""The demo's measurement, one process and one load of the target: each drafter's offline τ on RUN's held-out
features per held-out source (RUN/demo/offline-<label>.json), then the live bench of plain decoding against
eval.checkpoint and bench.drafters on the embedded backend with the drafters already loaded, then its economics.
eval/report/demo_summary.py's `offline` and `measure` run it; its `headline` reads what it wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from eagle3ft.config import BenchConfig, Config, EvalConfig, HarvestConfig
from eagle3ft.data.render import load_prompt_sets
from eagle3ft.data.sources import heldout_sets
from eagle3ft.data.store import FeatureDataset, FeatureStore
from eagle3ft.drafter.folder import DrafterFolder
from eagle3ft.eval.bench import schedule
from eagle3ft.eval.bench.backend import bench_drafters
from eagle3ft.eval.bench.embedded_backend import EmbeddedBackend
from eagle3ft.eval.bench.format import format_summary
from eagle3ft.eval.economics.analysis import after_bench
from eagle3ft.eval.offline.accept_len import evaluate
from eagle3ft.files import write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.targets.hf import load_input_embedding, pick_device


def offline_by_source(drafter, ds, groups: dict[str, list[int]], steps: int, device) -> dict:
    """Chain greedy offline tau per group: conversations, roots, answer tokens, tau per d/1/d+1 setting, per depth."""
    out = {}
    for kind, idx in groups.items():
        items = [ds[i] for i in idx]
        rep = evaluate(drafter, iter(items), steps, 1, steps + 1, 0.0, device)
        out[kind] = {
            "conversations": rep.samples,
            "roots": rep.roots,
            "answer_tokens": int(sum(int(it["loss_mask"].sum()) for it in items)),
            "settings": {k: v["tau"] for k, v in rep.settings.items()},
            "per_depth": rep.greedy["per_depth"],
        }
    return out


def check_drafters(
    harvest: HarvestConfig, run_dir: Path, folders: dict[str, DrafterFolder]
) -> tuple[FeatureDataset, dict[str, list[int]]]:
    """Every folder against the run's features, before anything is loaded; returns (the held-out dataset, its sample
    indices per source)."""
    store = FeatureStore(RunDir(run_dir).features)
    for folder in folders.values():
        store.check_drafter(folder)
    return store.dataset("heldout"), heldout_sets(store, harvest)


def offline_all(
    ev: EvalConfig,
    run_dir: Path,
    drafters: dict,
    folders: dict[str, DrafterFolder],
    held: tuple[FeatureDataset, dict[str, list[int]]],
    device: torch.device,
    log: Callable[[str], None] = print,
) -> dict[str, dict]:
    """Offline tau per held-out source for each loaded drafter; writes RUN/demo/offline-<label>.json. `held` is
    check_drafters' (dataset, sample indices per source)."""
    ds, groups = held
    out_dir = RunDir(run_dir).demo
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for label, drafter in drafters.items():
        with torch.no_grad():
            sets = offline_by_source(drafter, ds, groups, ev.steps, device)
        res = {"label": label, "checkpoint": str(folders[label].path), "depth": ev.steps, "sets": sets}
        write_json(out_dir / f"offline-{label}.json", res, indent=2, newline=True)
        results[label] = res
        for kind, s in sets.items():
            taus = ", ".join(f"{k} {v:.3f}" for k, v in s["settings"].items())
            log(
                f"{label:>10} on held-out {kind}: {s['conversations']} conversations, "
                f"{s['answer_tokens']} answer tokens: tau {taus}"
            )
    return results


def _pick(ev: EvalConfig, bench: BenchConfig, only: list[str] | None) -> list[str]:
    """The drafters' labels (eval.checkpoint, then bench.drafters), or those in `only`."""
    labels = [ev.checkpoint, *bench.drafters]
    unknown = sorted(set(only or []) - set(labels))
    if unknown:
        raise ValueError(
            f"--only {unknown}: not a drafter of this config (eval.checkpoint or bench.drafters: {labels})"
        )
    return [k for k in labels if not only or k in only]


def run_offline(
    cfg: Config, run_dir: Path, only: list[str] | None = None, log: Callable[[str], None] = print
) -> dict[str, dict]:
    """Offline tau per held-out source for each drafter (or those in `only`), in the target's dtype."""

    folders = bench_drafters(cfg.eval, cfg.bench, run_dir, _pick(cfg.eval, cfg.bench, only))
    held = check_drafters(cfg.harvest, run_dir, folders)
    device = pick_device(cfg.target)
    emb = load_input_embedding(cfg.target)
    drafters = {k: f.load_like(emb, device) for k, f in folders.items()}
    return offline_all(cfg.eval, run_dir, drafters, folders, held, device, log)


def run_measure(cfg: Config, run_dir: Path, log: Callable[[str], None] = print) -> dict:
    """One process, one target load: every drafter's offline tau per held-out set, then the live bench (plain
    against eval.checkpoint and bench.drafters, interleaved, every prompt set) with the drafters the bench loaded, then
    the bench's economics."""
    if cfg.bench.backend != "embedded":
        raise ValueError(f"bench.backend {cfg.bench.backend!r}: the demo measures with the embedded backend")
    folders = bench_drafters(cfg.eval, cfg.bench, run_dir)
    held = check_drafters(cfg.harvest, run_dir, folders)
    backend = EmbeddedBackend(cfg, run_dir, folders)
    offline_all(cfg.eval, run_dir, backend.drafters, folders, held, backend.device, log)
    sets = load_prompt_sets(cfg.target, cfg.bench, backend.tokenizer)
    summary = schedule.run(cfg.eval, cfg.bench, run_dir, backend, sets, log)
    after_bench(run_dir, cfg.bench, cfg.target, log)
    log(format_summary(summary))
    return summary
