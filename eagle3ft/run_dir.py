"""The run folder (--run-dir): every path a stage writes there or reads from an earlier stage.

config.yaml  logs/  serve/  .lock                    every stage (eagle3ft/cli.py, runlock.py, the launcher)
tokens/  magpie/  features/  vocab.safetensors       data (regen, magpie, harvest)
ckpt/  export/  export-best/  train/                 train
eval/  bench/  demo/                                 eval
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = ".lock"  # eagle3ft/runlock.py


class Under:
    """A path of the run folder: the RunDir attribute `parent` ("root" or another path) / `name`."""

    def __init__(self, parent: str, name: str):
        self.parent, self.name = parent, name

    def __get__(self, run: RunDir | None, owner: type | None = None) -> Path:
        if run is None:
            raise AttributeError(f"RunDir's paths are read from a RunDir, not the class ({self.name})")
        return getattr(run, self.parent) / self.name


@dataclass(frozen=True)
class RunDir:
    """The layout under `root`; `RunDir(run_dir).features` is RUN/features."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # every stage
    config = Under("root", "config.yaml")  # the resolved config of each stage that ran (eagle3ft/cli.py)
    lock = Under("root", LOCK_NAME)
    serve = Under("root", "serve")  # SGLang server logs (unless serve.log_dir names another folder)

    def error_log(self, stage: str) -> Path:
        return self.root / "logs" / f"{stage}-error.log"

    # data
    tokens = Under("root", "tokens")  # the token store data/regen.py writes (train.features online reads it)
    magpie = Under("root", "magpie")
    features = Under("root", "features")  # the feature store data/harvest.py writes
    features_manifest = Under("features", "manifest.json")  # there once a harvest has committed
    vocab = Under("root", "vocab.safetensors")  # the draft vocabulary (d2t/t2d) the harvest counted

    # train
    ckpt = Under("root", "ckpt")  # resume checkpoints, one step-N/ folder each
    export = Under("root", "export")  # the last step's drafter in SGLang's form
    export_best = Under("root", "export-best")  # the best step's drafter by held-out tau
    train = Under("root", "train")
    metrics = Under("train", "metrics.jsonl")

    @property
    def training_outputs(self) -> tuple[Path, ...]:
        """What training writes: a folder holding any of them belongs to a started run (train/outputs.py)."""
        return (self.ckpt, self.export, self.export_best, self.train)

    # eval
    eval = Under("root", "eval")  # offline accept length, held-out tau, the report
    accept_len = Under("eval", "accept_len.json")
    report_md = Under("eval", "report.md")
    bench = Under("root", "bench")  # the live benchmark and what is priced from it
    bench_summary = Under("bench", "summary.json")
    bench_runs = Under("bench", "runs.jsonl")
    calibration = Under("bench", "calibration.json")
    prediction = Under("bench", "prediction.json")
    economics = Under("bench", "economics.json")
    demo = Under("root", "demo")

    def drafter(self, checkpoint: str) -> Path:
        """The evaluated drafter's folder: eval.checkpoint (default "export"), relative to the run unless absolute."""
        p = Path(os.path.expanduser(checkpoint))
        return p if p.is_absolute() else self.root / p

    @property
    def derived(self) -> tuple[Path, ...]:
        """What the later stages make from an export: stale once training starts over."""
        return (self.eval, self.bench)
