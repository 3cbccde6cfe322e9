"""`eagle3ft STAGE ARGS`: one command for every stage, each subcommand the stage's own `main(argv)`.

    eagle3ft --help              the stages
    eagle3ft harvest --help      that stage's own options

A stage's module is imported only when its subcommand runs, so `eagle3ft --help` loads no stage (nor torch).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

# subcommand -> ("module:function" of its console entry, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "magpie": ("eagle3ft.data.magpie:main", "prompts written by the target itself -> RUN/magpie/prompts.jsonl"),
    "regen": ("eagle3ft.data.regen:main", "the target answers every prompt -> the token store RUN/tokens"),
    "harvest": ("eagle3ft.data.harvest:main", "prompts -> the target's features -> RUN/features, RUN/vocab"),
    "train": ("eagle3ft.train.launcher:main", "accelerate launch of train/finetune.py -> RUN/ckpt, RUN/export"),
    "eval": ("eagle3ft.eval.offline.accept_len:main", "offline accept length on held-out features -> RUN/eval"),
    "bench": ("eagle3ft.eval.bench.live:main", "live baseline vs speculation, interleaved -> RUN/bench"),
    "economics": ("eagle3ft.eval.economics.analysis:main", "break-even accept length and predicted tok/s"),
    "report": ("eagle3ft.eval.report.build:main", "offline and live results joined -> RUN/report.md"),
    "compare": ("eagle3ft.eval.offline.compare:main", "two drafters' τ per held-out set, and a verdict"),
    "sglang-check": ("eagle3ft.targets.sglang_check:main", "a running SGLang server: version, aux ids, hidden states"),
}
# stages whose torch runs on the CPU beside other work: spinning OpenMP threads slow it on a busy CPU (shared CI,
# 2 cores) by 10-25x, so they wait passively; set before the stage's module loads torch
PASSIVE_OPENMP = ("magpie", "regen", "harvest")


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(
        [
            "usage: eagle3ft STAGE [--help | ARGS]",
            "",
            "Harvest target features, fine-tune an EAGLE-3 drafter, prove the speed-up.",
            "",
            "stages:",
            *lines,
            "",
            "Most stages take --config FILE --run-dir RUN [--set SECTION.KEY=VALUE ...]; `eagle3ft STAGE --help` says.",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"{usage()}\n\neagle3ft: error: unknown stage {name!r}", file=sys.stderr)
        raise SystemExit(2)
    module, function = COMMANDS[name][0].split(":")
    if name in PASSIVE_OPENMP:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.argv[0] = f"eagle3ft {name}"  # the stage's argparse names itself so in its usage and errors
    entry = getattr(importlib.import_module(module), function)
    raise SystemExit(entry(rest))


def script() -> None:
    """`eagle3ft-STAGE ARGS`, the older console scripts: exactly `eagle3ft STAGE ARGS`."""
    main([Path(sys.argv[0]).name.removeprefix("eagle3ft-"), *sys.argv[1:]])
