"""The command line every entry point shares: --config, --set, --run-dir (and --debug), the resolved config written
into the run folder with the code version, and errors in the input as one line instead of a traceback.

    cfg, run_dir, args = parse_cli(description, stage="harvest", parser=optional_extended_parser)
    run_stage(description, "regen", run_regen, RegenError, argv=argv)  # a stage that writes one summary
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import traceback
from contextlib import contextmanager, nullcontext, redirect_stderr
from pathlib import Path
from typing import Callable

import yaml

from eagle3ft.config import REPO_ROOT, Config, ConfigError, load_config, to_dict
from eagle3ft.files import FULL, DiskFull, disk_full_error, json_text, write_atomic
from eagle3ft.run_dir import LOCK_NAME, RunDir


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


def save_resolved(cfg: Config, run_dir: str | os.PathLike, stage: str, extra: dict | None = None) -> Path:
    """Write run_dir/config.yaml: the resolved config of every stage that ran, plus the code version.

    Each stage adds its own entry under `stages`, so the file records every stage's view; `extra` adds keys to the
    stage's entry (train: where a resume started).
    """
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    out = RunDir(run_dir).config
    doc = read_record(out)
    remove_stale_records(Path(run_dir))
    doc.setdefault("stages", {})[stage] = {"code_version": code_version(), "config": to_dict(cfg), **(extra or {})}
    write_atomic(
        out, yaml.safe_dump(doc, sort_keys=False), f".config.yaml.{os.getpid()}.tmp"
    )  # ranks may write at once
    return out


STALE_TMP_S = 60.0  # a record's temporary file untouched this long, of a process gone, was left by a kill


def remove_stale_records(run_dir: Path) -> list[Path]:
    """Remove the `.config.yaml.<pid>.tmp` files that a process killed while it wrote config.yaml left (its pid gone
    from this host, the file untouched for STALE_TMP_S); returns them."""
    import time

    from eagle3ft.runlock import pid_alive

    removed = []
    for p in run_dir.glob(".config.yaml.*.tmp"):
        pid = p.name.removeprefix(".config.yaml.").removesuffix(".tmp")
        if not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        try:
            if time.time() - p.lstat().st_mtime >= STALE_TMP_S and not p.is_dir():
                p.unlink()
                removed.append(p)
        except FileNotFoundError:
            pass
    return removed


def read_record(path: Path) -> dict:
    """A run's config.yaml as save_resolved wrote it ({} when absent or empty); ConfigError naming the file when it is
    unparsable or something else (a user's own config file in the run folder), which is then never rewritten."""
    if not path.exists() and not path.is_symlink():
        return {}
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        reason = " ".join(str(e).split())[:200]
        raise ConfigError(
            f"{path}: not a run's record, unreadable ({reason}); nothing was written: move it away"
        ) from None
    if doc is None:
        return {}
    if not isinstance(doc, dict) or not isinstance(doc.get("stages"), dict):
        raise ConfigError(
            f"{path}: not a run's record (a mapping with `stages`, which every stage writes); nothing was written: "
            "check --run-dir, or move that file away"
        )
    return doc


# the stages that read what earlier stages wrote: their --run-dir must already be a run
READ_SIDE = ("eval", "bench", "economics", "report", "compare")
# what an earlier stage leaves in a run folder, beside its config.yaml record
RUN_OUTPUTS = (
    LOCK_NAME,  # a stage is writing there (its lock names it)
    "features/manifest.json",
    "tokens/manifest.json",
    "export",
    "export-best",
    "ckpt",
    "train",
    "eval",
    "bench",
)


def run_dir_problem(run_dir: Path, stage: str, read_side: bool | None = None) -> str | None:
    """Why `stage` may not record itself in `run_dir` (None: it may): --run-dir naming a file; a config.yaml that is
    not a run's record (read_record); for the read-side stages, a folder that does not exist (it is not created) or
    that holds things but no run (no record, none of RUN_OUTPUTS)."""
    if run_dir.exists() and not run_dir.is_dir():
        return f"--run-dir {run_dir} is a file, not a run folder"
    try:
        record = read_record(RunDir(run_dir).config)
    except ConfigError as e:
        return str(e)
    if not (stage in READ_SIDE if read_side is None else read_side):
        return None
    if not run_dir.is_dir():
        alone = "; to benchmark running servers alone, create it first" if stage == "bench" else ""
        return f"no run folder {run_dir}: {stage} reads what earlier stages wrote there (check --run-dir){alone}"
    if not record and any(run_dir.iterdir()) and not any((run_dir / n).exists() for n in RUN_OUTPUTS):
        return (
            f"{run_dir} is not a run folder (no config.yaml of a stage, no {', '.join(RUN_OUTPUTS)}): nothing was "
            "written; check --run-dir"
        )
    return None


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
    ap.add_argument(
        "--run-dir", required=True, help="the run folder (created if missing, except by the stages that read a run)"
    )
    ap.add_argument("--debug", action="store_true", help=f"show the traceback behind an error (or set {DEBUG_ENV}=1)")
    return ap


DEBUG_ENV = "EAGLE3FT_DEBUG"
USER_ERRORS = (
    ConfigError,
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    IsADirectoryError,
    PermissionError,
    DiskFull,
)


def is_rank0() -> bool:
    """True unless a launcher of several processes made this process a rank other than 0."""
    return int(os.environ.get("RANK", "0")) == 0


def command_name(script: str) -> str:
    """The command the user typed, to name it in errors: `eagle3ft STAGE` (eagle3ft/commands.py sets sys.argv[0] so;
    the eagle3ft-STAGE scripts are aliases of it), else `script`, the file run as `python .../script`."""
    return sys.argv[0] if sys.argv[0].startswith("eagle3ft ") else script


def error_log(run_dir: str | os.PathLike, stage: str) -> Path:
    return RunDir(run_dir).error_log(stage)


def _write_log(log: Path, error: BaseException) -> None:
    """The traceback into `log`, when its run folder exists (an error does not create one) and is not in use by
    another stage (RunLocked)."""
    from eagle3ft.runlock import RunLocked

    if isinstance(error, RunLocked) or not log.parent.parent.is_dir():
        return
    try:
        log.parent.mkdir(exist_ok=True)
        write_atomic(log, "".join(traceback.format_exception(error)))
    except OSError:
        pass


@contextmanager
def cli_errors(
    prog: str,
    *more: type[BaseException],
    log: Path | None = None,
    end_launch: Callable[[bool], bool] | None = None,
):
    """An entry point's body: an error in the input (USER_ERRORS, plus `more`) exits 1 with one line
    `<prog>: error: <message>`; the traceback goes to `log` (error_log(run_dir, stage)), and to the console only with
    --debug or EAGLE3FT_DEBUG=1. Under a launcher of several processes rank 0 alone prints the line:
    `end_launch(is_rank0)` (train/launcher.py) ends the launch before the launcher reports the failed ranks, and
    returns False on a rank whose launcher is still there (its error then was its own, so it prints it). An interrupt
    (SIGINT) exits 130 with `<prog>: interrupted`."""
    try:
        try:
            yield
        except OSError as e:  # a full disk where no writer named the file (eagle3ft/files.py's disk_full)
            if e.errno not in FULL or isinstance(e, DiskFull):
                raise
            raise disk_full_error(e.filename or "a write") from None
    except USER_ERRORS + more as e:
        if log is not None and is_rank0():
            _write_log(log, e)
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            traceback.print_exc()
        msg = " ".join(str(e).split("\n")) or type(e).__name__
        if is_rank0():
            print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
        if end_launch is not None:
            from eagle3ft.runlock import release_all

            release_all()
        if (end_launch is not None and not end_launch(is_rank0())) or (end_launch is None and not is_rank0()):
            print(f"{prog}: error (rank {os.environ['RANK']}): {msg}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # Ctrl-C or `timeout -s INT`: the stages commit as they go, so one line, not a traceback
        if is_rank0():
            print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


@contextmanager
def rank0_voice(end_launch: Callable[[bool], bool] | None = None):
    """Argument and config parsing under a launcher of several processes: only rank 0's error message is printed,
    and a failed parse ends the launch (end_launch, as in cli_errors)."""
    heard = io.StringIO()
    try:
        with redirect_stderr(heard) if not is_rank0() else nullcontext():
            yield
    except SystemExit as e:
        if e.code and end_launch is not None:
            from eagle3ft.runlock import release_all

            release_all()  # ending the launch kills this process too
            if not end_launch(is_rank0()):
                sys.stderr.write(heard.getvalue())
        raise


def parse_cli(
    description: str,
    stage: str,
    argv: list[str] | None = None,
    parser: argparse.ArgumentParser | None = None,
    record: bool = True,
    read_side: bool | None = None,
):
    """Parse the three shared options (plus any the stage's parser adds), load, save.

    Returns (config, run_dir, namespace). A bad config exits 2 with a one-line message, and so does a run_dir that
    run_dir_problem refuses (read_side: the stage needs a run there; None: by its name, READ_SIDE). With
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
    if problem := run_dir_problem(run_dir, stage, read_side):
        ap.exit(2, f"{ap.prog}: error: {problem}\n")
    if record:
        from eagle3ft.runlock import holding

        with holding(run_dir, stage, ap.prog):  # a folder in use by another stage is not written to
            save_resolved(cfg, run_dir, stage)
    return cfg, run_dir, args


def run_stage(
    description: str,
    stage: str,
    work: Callable[[Config, Path], dict],
    *errors: type[BaseException],
    argv: list[str] | None = None,
) -> None:
    """A stage's console entry: parse (parse_cli, the config recorded by `work` itself once its inputs are accepted),
    hold the run folder, run `work(cfg, run_dir)` with an input error (USER_ERRORS, plus `errors`) as one line, and
    print the summary it returns."""
    from eagle3ft.runlock import holding

    cfg, run_dir, _ = parse_cli(description, stage=stage, argv=argv, record=False)
    with holding(run_dir, stage), cli_errors(command_name(stage), *errors, log=error_log(run_dir, stage)):
        summary = work(cfg, run_dir)
    print(json_text(summary, f"{stage} summary", indent=1))
