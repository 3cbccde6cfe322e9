"""Record an SGLang version's launch parser: every option string `python -m sglang.launch_server` takes, how many
values it reads and its choices, read from that version's own ``ServerArgs.add_cli_args``. The product checks the
server commands it builds against these records (eagle3ft/targets/sglang_versions.py), emulating argparse's
matching (exact, else a unique prefix, else "ambiguous option"), so CI needs neither SGLang nor its dependencies.

    PYTHONPATH=SGLANG_TREE:DEPS python benchmarks/sglang_cli_options.py --out tests/fixtures/sglang-0.5.23/cli_options.json
    PYTHONPATH=SGLANG_TREE:DEPS python benchmarks/sglang_cli_options.py --check ARGV.json

SGLANG_TREE is an unzipped wheel (``pip download --no-deps sglang==V``); importing its server_args on a CPU takes
a few pure-Python packages (orjson, pybase64, starlette, msgspec, pyzmq, IPython, aiohttp, openai,
partial-json-parser, xgrammar, sentencepiece, ...); 0.5.17 also wants its pinned transformers 5.12.1 and
torchvision, which is stubbed here (the parser never touches it). ``--check`` parses each argv of a JSON list with
the real parser and, where the version has it, runs its aux-capture launch check on the result; it prints one
JSON line per argv (ok, or the parser's or the check's own message).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import sys
import types
from importlib.metadata import version as dist_version
from pathlib import Path
from unittest import mock


class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Modules the parser's import tree names but never runs (torchvision on a CPU without it)."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__ = []
        m.__getattr__ = lambda attr: mock.MagicMock(name=f"{spec.name}.{attr}")
        return m

    def exec_module(self, module):
        pass


def load_parser() -> tuple[argparse.ArgumentParser, str]:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        sys.meta_path.insert(0, _Stub(["torchvision"]))
    from sglang.srt.server_args import ServerArgs

    ap = argparse.ArgumentParser(prog="sglang serve")  # as prepare_server_args builds it
    ServerArgs.add_cli_args(ap)
    try:
        from sglang.version import __version__ as v
    except ImportError:
        v = dist_version("sglang")
    return ap, v


def record(ap: argparse.ArgumentParser, v: str) -> dict:
    options = {}
    for action in ap._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        if action.nargs == 0 or isinstance(
            action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)
        ):
            nargs = 0
        elif action.nargs is None:
            nargs = 1
        else:
            nargs = action.nargs
        entry = {"dest": action.dest, "nargs": nargs}
        if action.choices is not None:
            entry["choices"] = sorted(str(c) for c in action.choices)
        for s in action.option_strings:
            options[s] = entry
    return {"version": v, "options": dict(sorted(options.items()))}


def check(ap: argparse.ArgumentParser, argvs: list[list[str]]) -> None:
    hook = None
    try:
        from sglang.srt.arg_groups.validation_hook import handle_aux_hidden_state_capture as hook
    except ImportError:
        pass

    def refuse(message):
        raise ValueError(message)

    ap.error = refuse
    for argv in argvs:
        try:
            ns = ap.parse_args(argv)
            if hook is not None:
                hook(ns)
            print(json.dumps({"argv": argv, "ok": True}))
        except (ValueError, TypeError) as e:
            print(json.dumps({"argv": argv, "ok": False, "message": str(e)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the record here")
    ap.add_argument("--check", help="a JSON list of argv lists to parse")
    args = ap.parse_args()
    parser, v = load_parser()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record(parser, v), indent=1) + "\n")
        print(f"sglang {v}: {len(record(parser, v)['options'])} option strings -> {args.out}")
    if args.check:
        check(parser, json.loads(Path(args.check).read_text()))


if __name__ == "__main__":
    main()
