"""The command line every entry point shares: --config, --set, --run-dir (and --debug), the resolved config written
into the run folder with the code version, and errors in the input as one line instead of a traceback.

    cfg, run_dir, args = parse_cli(description, stage="harvest", parser=optional_extended_parser)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

import yaml

from eagle3ft.config import REPO_ROOT, Config, ConfigError, load_config, to_dict
from eagle3ft.files import write_atomic


def code_version() -> str:
    """The package version plus the git commit (and '-dirty') when run from a checkout."""
    from eagle3ft import __version__

    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        )
        if sha.returncode == 0:
            return f"{__version__}+g{sha.stdout.strip()}{'-dirty' if dirty.stdout.strip() else ''}"
    except (OSError, subprocess.SubprocessError):
        pass
    return __version__


def save_resolved(cfg: Config, run_dir: str | os.PathLike, stage: str) -> Path:
    """Write run_dir/config.yaml: the resolved config of every stage that ran, plus the code version.

    Each stage adds its own entry under `stages`, so the file records every stage's view.
    """
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    out = run / "config.yaml"
    doc = yaml.safe_load(out.read_text()) if out.exists() else {}
    doc = doc if isinstance(doc, dict) else {}
    doc.setdefault("stages", {})[stage] = {"code_version": code_version(), "config": to_dict(cfg)}
    write_atomic(
        out, yaml.safe_dump(doc, sort_keys=False), f".config.yaml.{os.getpid()}.tmp"
    )  # ranks may write at once
    return out


def build_parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", required=True, help="YAML config file")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="dotted override, repeatable",
    )
    ap.add_argument("--run-dir", required=True, help="the run folder (created if missing)")
    ap.add_argument("--debug", action="store_true", help=f"show the traceback behind an error (or set {DEBUG_ENV}=1)")
    return ap


DEBUG_ENV = "EAGLE3FT_DEBUG"
USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


@contextmanager
def cli_errors(prog: str, *more: type[BaseException]):
    """An entry point's body: an error in the input (USER_ERRORS, plus `more`) exits 1 with one line
    `<prog>: error: <message>`; the traceback follows only with --debug or EAGLE3FT_DEBUG=1."""
    try:
        yield
    except USER_ERRORS + more as e:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            traceback.print_exc()
        msg = " ".join(str(e).split("\n")) or type(e).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def parse_cli(
    description: str,
    stage: str,
    argv: list[str] | None = None,
    parser: argparse.ArgumentParser | None = None,
    record: bool = True,
):
    """Parse the three shared options (plus any the stage's parser adds), load, save.

    Returns (config, run_dir, namespace). A bad config exits 2 with a one-line message. With
    record=False the caller writes run_dir/config.yaml itself (save_resolved), e.g. on one rank only.
    """
    ap = parser or build_parser(description)
    args = ap.parse_args(argv)
    if getattr(args, "debug", False):
        os.environ[DEBUG_ENV] = "1"  # cli_errors and any subprocess see it
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    run_dir = Path(args.run_dir)
    if record:
        from eagle3ft.runlock import holding

        with holding(run_dir, stage, ap.prog):  # a folder in use by another stage is not written to
            save_resolved(cfg, run_dir, stage)
    return cfg, run_dir, args
