"""Start, wait for and stop SGLang servers, every flag from the config (section ``serve``).

Three roles, one command builder:

- ``harvest``: the target with ``--enable-return-hidden-states`` and a way to make the
  hidden states the drafter's aux layers: ``serve.harvest_capture: eagle3`` loads a draft
  model (its ``eagle_aux_hidden_state_layer_ids`` pick the layers; works on every SGLang
  with EAGLE3) at the cheapest setting ``serve.harvest_setting``, running as many requests
  as the harvest sends (an EAGLE3 server caps them at 48 unless told); ``aux_flag`` passes
  ``serve.aux_capture_args`` plus the ids unchanged (SGLang 0.5.23, no draft model).
- ``baseline``: plain serving, for the live benchmark.
- ``speculative``: EAGLE3 with the exported drafter and one steps/topk/draft-tokens setting, or DFLASH with a DFlash
  drafter folder and its block.

    python -m eagle3ft.targets.sglang_server --config CFG --run-dir RUN --role speculative \
        --drafter RUN/export --setting 3/1/4 [--port 30001] [--print] [-- COMMAND ...]

Every command is checked against ``serve.sglang_version``'s flags and launch rules
(eagle3ft/targets/sglang_versions.py) before it starts. ``main`` runs one server in the
foreground until SIGINT/SIGTERM; with ``-- COMMAND``, runs the command once the server is healthy, then stops the server and exits with the command's status (the
harvest recipe); ``--print`` only prints the server command. ``SGLangServer`` does the same
from Python (the bench's ``bench.sglang.launch``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from eagle3ft.cli import build_parser, parse_cli
from eagle3ft.config import BenchConfig, Config, DrafterSection, HarvestConfig, ServeConfig, TargetConfig, resolve_path
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.run_dir import RunDir
from eagle3ft.setting import Setting
from eagle3ft.targets import sglang_versions

ROLES = ("harvest", "baseline", "speculative")


class LaunchError(RuntimeError):
    """A server that could not be built, started or stopped as configured."""


@dataclass
class ServerCommand:
    argv: list[str]
    env: dict[str, str]  # added to the inherited environment
    url: str
    role: str

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return (env + " " if env else "") + shlex.join(self.argv)


def check_setting(s: Setting) -> None:
    """Settings SGLang refuses (Setting itself checks that each is positive): a chain (topk 1) verifies at most
    steps + 1 tokens."""
    if s.num_draft_tokens < 2:
        raise LaunchError(f"speculative setting {s}: num_draft_tokens >= 2")
    if s.topk == 1 and s.num_draft_tokens > s.steps + 1:
        raise LaunchError(
            f"speculative setting {s}: with topk 1, num_draft_tokens is at most steps + 1 = {s.steps + 1}"
        )


def drafter_aux_ids(folder: str | Path, num_layers: int | None = None) -> list[int]:
    """The aux layer ids a drafter folder makes SGLang capture (its config.json, else SGLang's default)."""
    spec = DrafterConfig.from_json(Path(folder) / "config.json")
    if spec.aux_layer_ids is not None:
        return list(spec.aux_layer_ids)
    if num_layers is None:
        raise LaunchError(f"{folder}: config.json names no eagle_aux_hidden_state_layer_ids")
    from eagle3ft.drafter.config import default_aux_layer_ids

    return default_aux_layer_ids(num_layers)


def _speculative_args(drafter: str | Path, s: Setting) -> list[str]:
    check_setting(s)
    return [
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", str(drafter),
        "--speculative-num-steps", str(s.steps),
        "--speculative-eagle-topk", str(s.topk),
        "--speculative-num-draft-tokens", str(s.num_draft_tokens),
    ]  # fmt: skip


def _is_dflash_config(path: Path) -> bool:
    """Whether a drafter config.json is a DFlash drafter's (its architectures)."""
    from eagle3ft.drafter.folder import DFLASH_KIND, family_of
    from eagle3ft.files import read_json

    return Path(path).is_file() and family_of(read_json(path, "the drafter config")) == DFLASH_KIND


def _is_dflash(folder: Path) -> bool:
    return _is_dflash_config(Path(folder) / "config.json")


def _dflash_args(drafter: Path, s: Setting | None) -> list[str]:
    """SGLang's DFLASH flags for a DFlash drafter folder: its block B verified per cycle (a setting, when given, must
    be B-1/1/B); the draft attention backend follows --attention-backend (triton when serve names none, as the
    wheel set has no FA3 and the flashinfer fallback must not be hit)."""
    from eagle3ft.drafter.dflash_config import DFlashConfig

    B = DFlashConfig.from_json(drafter / "config.json").block_size
    if s is not None and (s.steps, s.topk, s.num_draft_tokens) != (B - 1, 1, B):
        raise LaunchError(f"DFlash drafter {drafter} (block {B}): setting {s.key} must be {B - 1}/1/{B}")
    return [
        "--speculative-algorithm", "DFLASH",
        "--speculative-draft-model-path", str(drafter),
        "--speculative-num-draft-tokens", str(B),
    ]  # fmt: skip


def _harvest_capture_ids(serve: ServeConfig, target: TargetConfig, drafter: DrafterSection) -> list[int]:
    """A DFlash drafter.config's layers in EAGLE-3's numbering on the served model (eagle3ft.targets.DFlashCapture):
    what the harvest server's EAGLE3 capture must be asked for; the architectures, where they matter, from
    serve.model_path's config.json, else the target's."""
    from eagle3ft.drafter.dflash_config import DFlashConfig
    from eagle3ft.files import read_json
    from eagle3ft.targets import DFlashCapture
    from eagle3ft.targets.sglang import target_architectures

    def architectures():
        served = resolve_path(serve.model_path) / "config.json"
        if served.is_file():
            return read_json(served, "the served model's config").get("architectures")
        return target_architectures(target)

    try:
        return DFlashCapture(DFlashConfig.from_json(resolve_path(drafter.config)), architectures).ids
    except ValueError as e:
        raise LaunchError(f"role harvest: {e}") from None


def build_command(
    cfg: Config,
    role: str,
    port: int | None = None,
    drafter: str | Path | None = None,
    setting: Setting | None = None,
) -> ServerCommand:
    """The server's argv and extra environment for one role; raises LaunchError on a config that cannot serve it."""
    sv = cfg.serve
    if role not in ROLES:
        raise LaunchError(f"role {role!r}: one of {', '.join(ROLES)}")
    if not sv.model_path:
        raise LaunchError("serve.model_path is not set (an HF folder SGLang can load)")
    port = sv.port if port is None else port
    argv = [
        sv.python,
        *sv.launch_cmd,
        "--model-path",
        str(resolve_path(sv.model_path)),
        "--host",
        sv.host,
        "--port",
        str(port),
    ]
    argv += ["--tp-size", str(sv.tp), "--mem-fraction-static", str(sv.mem_fraction_static)]
    if sv.attention_backend:
        argv += ["--attention-backend", sv.attention_backend]
    if sv.sampling_backend:
        argv += ["--sampling-backend", sv.sampling_backend]
    if sv.chat_template:
        argv += ["--chat-template", sv.chat_template]
    if sv.trust_remote_code:
        argv += ["--trust-remote-code"]
    env = dict(sv.env)
    if role == "harvest":
        dflash = _is_dflash_config(resolve_path(cfg.drafter.config))
        want = (
            _harvest_capture_ids(cfg.serve, cfg.target, cfg.drafter)
            if dflash
            else DrafterConfig.from_json(resolve_path(cfg.drafter.config)).aux_layer_ids
        )
        argv += ["--enable-return-hidden-states"]
        env.update(sv.harvest_env)
        if sv.harvest_capture == "eagle3":
            draft = drafter or sv.harvest_draft or (None if dflash else cfg.drafter.init)
            if not draft:
                raise LaunchError(
                    "harvest_capture eagle3 needs a draft model folder: serve.harvest_draft or drafter.init (SGLang "
                    "reads the aux layer ids from its config.json; for a DFlash drafter, an EAGLE-3 config.json naming "
                    f"{want}, loaded with --speculative-draft-load-format dummy)"
                )
            draft = resolve_path(str(draft))
            have = drafter_aux_ids(draft)
            if want is not None and list(want) != have:
                raise LaunchError(
                    f"harvest draft {draft} captures layers {have}, drafter.config {cfg.drafter.config} needs "
                    f"{list(want)}"
                )
            argv += _speculative_args(draft, sv.harvest_setting)
        elif sv.harvest_capture == "aux_flag":
            if want is None:
                raise LaunchError(
                    f"{cfg.drafter.config} names no eagle_aux_hidden_state_layer_ids to pass to "
                    f"{sv.aux_capture_args[-1]}"
                )
            argv += list(sv.aux_capture_args) + [str(i) for i in want]
        else:
            raise LaunchError(f"serve.harvest_capture {sv.harvest_capture!r}: eagle3 or aux_flag")
    elif role == "speculative":
        if drafter is None:
            raise LaunchError("role speculative needs the exported drafter folder")
        if _is_dflash(resolve_path(str(drafter))):
            block = _dflash_args(resolve_path(str(drafter)), setting)
            argv += block if sv.attention_backend else [*block, "--attention-backend", "triton"]
        else:
            argv += _speculative_args(
                resolve_path(str(drafter)), setting or (cfg.bench.settings[0] if cfg.bench.settings else Setting())
            )
    argv += list(sv.extra_args)
    running = _running_wanted(cfg.serve, cfg.harvest, cfg.bench, role)
    try:
        given = sglang_versions.check_args(sv.sglang_version, sglang_versions.server_args_after(sv.launch_cmd, argv))
        if running > sglang_versions.EAGLE3_RUNNING_DEFAULT and "max_running_requests" not in given:
            argv += ["--max-running-requests", str(running)]
    except sglang_versions.VersionError as e:
        raise LaunchError(f"{e} (serve.sglang_version {sv.sglang_version})") from None
    host = "127.0.0.1" if sv.host in ("0.0.0.0", "::") else sv.host
    return ServerCommand(argv=argv, env=env, url=f"http://{host}:{port}", role=role)


def _running_wanted(serve: ServeConfig, harvest: HarvestConfig, bench: BenchConfig, role: str) -> int:
    """Requests the role's client keeps in flight on one EAGLE3 or DFLASH server (0 on a server without a draft)."""
    if role == "harvest" and serve.harvest_capture == "eagle3":
        return int(harvest.sglang.concurrency)
    if role == "speculative":
        return max(bench.concurrency, default=1)
    return 0


def _die_with_parent() -> None:
    """In the child: SIGTERM when the process that started the server dies (Linux), so no server outlives its owner."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def health(url: str, timeout_s: float = 5.0) -> bool:
    try:
        return requests.get(url + "/health", timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


class SGLangServer:
    """One server process: start, wait for /health, stop (SIGTERM to its process group, then SIGKILL)."""

    def __init__(
        self,
        command: ServerCommand,
        log_file: str | Path,
        startup_timeout_s: float = 1800.0,
        stop_grace_s: float = 30.0,
    ):
        self.command = command
        self.log_file = Path(log_file)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return self.command.url

    def start(self) -> "SGLangServer":
        if health(self.url, 2.0):
            raise LaunchError(f"{self.url} already answers /health: another server holds the port")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "ab")
        log.write(f"$ {self.command.shell()}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            self.command.argv,
            env={**os.environ, **self.command.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.close()
        return self

    def wait_healthy(self, cancelled=lambda: False) -> "SGLangServer":
        """Poll /health until 200; raise with the log's tail if the process exits, time runs out or `cancelled()`."""
        deadline = time.monotonic() + self.startup_timeout_s
        delay = 0.2
        while time.monotonic() < deadline:
            if cancelled():
                raise LaunchError(f"{self.command.role} server start cancelled")
            if self.proc is not None and self.proc.poll() is not None:
                raise LaunchError(
                    f"{self.command.role} server exited with {self.proc.returncode} before answering /health; log "
                    f"{self.log_file}:\n{self.log_tail()}"
                )
            if health(self.url):
                return self
            time.sleep(delay)
            delay = min(delay * 1.5, 5.0)
        self.stop()
        raise LaunchError(
            f"{self.command.role} server at {self.url} not healthy after {self.startup_timeout_s:.0f} s; log "
            f"{self.log_file}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> int | None:
        """Stop the whole process group (SGLang forks scheduler and detokenizer processes)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        try:
            os.killpg(pgid, signal.SIGKILL)  # children that outlived the leader
        except ProcessLookupError:
            pass
        return self.proc.returncode

    def __enter__(self) -> "SGLangServer":
        self.start()
        try:
            return self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def server_for(
    cfg: Config,
    run_dir: str | Path,
    role: str,
    port: int | None = None,
    drafter=None,
    setting: Setting | None = None,
) -> SGLangServer:
    cmd = build_command(cfg, role, port, drafter, setting)
    log_dir = resolve_path(cfg.serve.log_dir) if cfg.serve.log_dir else RunDir(run_dir).serve
    suffix = "-" + setting.key.replace("/", "-") if setting is not None and role == "speculative" else ""
    return SGLangServer(
        cmd,
        log_dir / f"{role}{suffix}-{cmd.url.rsplit(':', 1)[-1]}.log",
        cfg.serve.startup_timeout_s,
        cfg.serve.stop_grace_s,
    )


def main(argv: list[str] | None = None) -> None:
    ap = build_parser("Run one SGLang server (harvest, baseline or speculative) from the config.")
    ap.add_argument("--role", required=True, choices=ROLES)
    ap.add_argument("--port", type=int)
    ap.add_argument("--drafter", help="drafter folder (SGLang form): the export for speculative, the draft for harvest")
    ap.add_argument("--setting", help="steps/topk/num_draft_tokens for speculative (default bench.settings[0])")
    ap.add_argument("--print", action="store_true", help="print the command and exit")
    ap.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- COMMAND: run it against the healthy server, then stop the server"
    )
    cfg, run_dir, args = parse_cli("", stage="serve", argv=argv, parser=ap)
    try:
        server = server_for(
            cfg, run_dir, args.role, args.port, args.drafter, Setting.parse(args.setting) if args.setting else None
        )
    except (LaunchError, ValueError, FileNotFoundError) as e:
        ap.exit(2, f"{ap.prog}: {e}\n")
    if args.print:
        print(server.command.shell())
        return
    stop = {"now": False}

    def on_signal(*_):
        stop["now"] = True

    saved = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code, died = _serve(server, args, stop)
    except LaunchError as e:
        ap.exit(1, f"{ap.prog}: {e}\n")
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    if died is not None:
        raise SystemExit(f"{args.role} server exited with {died} while in use; log {server.log_file}")
    if code:
        raise SystemExit(code)


def _serve(server: SGLangServer, args, stop: dict) -> tuple[int, int | None]:
    """Hold the server up (running `-- COMMAND` against it if given); (command status, server exit code if it died)."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    server.start()
    try:
        server.wait_healthy(lambda: stop["now"])
        print(
            json.dumps({"role": args.role, "url": server.url, "pid": server.proc.pid, "log": str(server.log_file)}),
            flush=True,
        )
        if command:
            child = subprocess.Popen(command)
            while child.poll() is None and not stop["now"] and server.proc.poll() is None:
                time.sleep(0.5)
            if child.poll() is None:
                child.terminate()
                child.wait()
            code = child.returncode
        else:
            while not stop["now"] and server.proc.poll() is None:
                time.sleep(0.5)
            code = 0
        died = server.proc.poll()  # before we stop it
    finally:
        server.stop()
    return code, died


if __name__ == "__main__":
    main()
