"""The run folder (--run-dir): every path a stage writes there or reads from an earlier stage.

config.yaml  logs/  serve/  .lock                    every stage (eagle3ft/cli.py, runlock.py, the launcher)
tokens/  magpie/  features/  vocab.safetensors       data (regen, magpie, harvest)
ckpt/  export/  export-best/  train/                 train
eval/  bench/  demo/                                 eval
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = ".lock"  # eagle3ft/runlock.py


@dataclass(frozen=True)
class RunDir:
    """The layout under `root`; `RunDir(run_dir).features` is RUN/features."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # every stage
    @property
    def config(self) -> Path:
        """The resolved config of each stage that ran (eagle3ft/cli.py's save_resolved)."""
        return self.root / "config.yaml"

    def error_log(self, stage: str) -> Path:
        return self.root / "logs" / f"{stage}-error.log"

    @property
    def lock(self) -> Path:
        return self.root / LOCK_NAME

    @property
    def serve(self) -> Path:
        """SGLang server logs (unless serve.log_dir names another folder)."""
        return self.root / "serve"

    # data
    @property
    def tokens(self) -> Path:
        """The token store data/regen.py writes (train.features online reads it)."""
        return self.root / "tokens"

    @property
    def magpie(self) -> Path:
        return self.root / "magpie"

    @property
    def features(self) -> Path:
        """The feature store data/harvest.py writes."""
        return self.root / "features"

    @property
    def features_manifest(self) -> Path:
        """The feature store's manifest: there once a harvest has committed."""
        return self.features / "manifest.json"

    @property
    def vocab(self) -> Path:
        """The draft vocabulary (d2t/t2d) the harvest counted."""
        return self.root / "vocab.safetensors"

    # train
    @property
    def ckpt(self) -> Path:
        """Resume checkpoints, one step-N/ folder each."""
        return self.root / "ckpt"

    @property
    def export(self) -> Path:
        """The last step's drafter in SGLang's form."""
        return self.root / "export"

    @property
    def export_best(self) -> Path:
        """The best step's drafter by held-out tau."""
        return self.root / "export-best"

    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def metrics(self) -> Path:
        return self.train / "metrics.jsonl"

    @property
    def training_outputs(self) -> tuple[Path, ...]:
        """What training writes: a folder holding any of them belongs to a started run (train/outputs.py)."""
        return (self.ckpt, self.export, self.export_best, self.train)

    # eval
    @property
    def eval(self) -> Path:
        """Offline accept length, held-out tau, the report."""
        return self.root / "eval"

    @property
    def accept_len(self) -> Path:
        return self.eval / "accept_len.json"

    @property
    def report_md(self) -> Path:
        return self.eval / "report.md"

    @property
    def bench(self) -> Path:
        """The live benchmark and what is priced from it."""
        return self.root / "bench"

    @property
    def bench_summary(self) -> Path:
        return self.bench / "summary.json"

    @property
    def bench_runs(self) -> Path:
        return self.bench / "runs.jsonl"

    @property
    def calibration(self) -> Path:
        return self.bench / "calibration.json"

    @property
    def prediction(self) -> Path:
        return self.bench / "prediction.json"

    @property
    def economics(self) -> Path:
        return self.bench / "economics.json"

    @property
    def demo(self) -> Path:
        return self.root / "demo"

    @property
    def derived(self) -> tuple[Path, ...]:
        """What the later stages make from an export: stale once training starts over."""
        return (self.eval, self.bench)
