"""The SGLang versions the product serves and harvests with, each held to its own code's rules.

Every server command the product builds passes ``check_args`` for ``serve.sglang_version`` before it starts, so a
flag that version refuses stops the launch with one line naming the version and the flag. What each version takes,
read from its wheel (``pip download --no-deps sglang==V``):

- **Flags**: ``sglang-cli/V.json``, every option string of that version's ``ServerArgs.add_cli_args`` with the number
  of values and the choices it takes (recorded by benchmarks/sglang_cli_options.py from the real parser).
  ``check_args`` matches as argparse does: an exact option, else a unique prefix, else "ambiguous option". So
  ``--cuda-graph-max-bs``, a deprecated alias in 0.5.17 (``srt/server_args.py:8315-8321``), is ambiguous in 0.5.23
  (``--cuda-graph-max-bs-decode``, ``--cuda-graph-max-bs-prefill``); ``--cuda-graph-max-bs-decode`` works on both.
  0.5.23 also dropped ``tc_piecewise`` from ``--cuda-graph-backend-prefill``'s choices.
- **Launch rules**: 0.5.23 captures aux hidden states without a draft (``srt/arg_groups/fields/exec_.py:130-157``)
  only with ``--speculative-algorithm`` EAGLE3, DFLASH or DSPARK naming the capture convention, no
  ``--speculative-draft-model-path``, pipeline-parallel size 1, and ``--return-aux-hidden-state-layer-ids`` only
  beside ``--enable-return-aux-hidden-states``, non-empty, non-negative and without repeats
  (``srt/arg_groups/validation_hook.py:697-754``); it then resets ``speculative_algorithm`` to null, so no draft
  loads. 0.5.17 has no aux flag. An EAGLE3 server without ``--max-running-requests`` runs at most 48 requests at
  once in both (0.5.17 ``srt/arg_groups/speculative_hook.py:540-541``, 0.5.23 ``:1086-1090``).
- **meta_info keys** of a finished speculative request: both send ``spec_verify_ct, spec_accept_length,
  spec_accept_rate, spec_num_correct_drafts, spec_num_proposed_drafts, spec_correct_drafts_histogram``
  (0.5.17 ``srt/managers/tokenizer_manager.py:2765-2806``, 0.5.23 ``:3164-3201``); 0.5.17 adds the twins
  ``spec_accepted_drafts, spec_proposed_drafts, spec_accept_histogram`` (``:2795-2810``, "remove in next release"),
  which 0.5.23 no longer sends.
- **Sampled verification**: ``speculative_accept_threshold_single``/``_acc`` and
  ``speculative_use_rejection_sampling`` in both; ``speculative_use_block_verification`` from 0.5.23
  (``srt/arg_groups/fields/spec.py:109-124``). They move τ at T > 0.

0.5.17 was run live on a GPU; 0.5.23 is checked by these rules only (it pins torch 2.14.1).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

SUPPORTED = ("0.5.17", "0.5.23")
AUX_CAPTURE_METHODS = ("EAGLE3", "DFLASH", "DSPARK")
EAGLE3_RUNNING_DEFAULT = 48  # max_running_requests an EAGLE3 server takes when the flag is unset
SPEC_META_KEYS = (
    "spec_verify_ct", "spec_accept_length", "spec_accept_rate", "spec_num_correct_drafts", "spec_num_proposed_drafts",
    "spec_correct_drafts_histogram",
)  # fmt: skip
SPEC_META_KEYS_REMOVED = ("spec_accept_histogram", "spec_accepted_drafts", "spec_proposed_drafts")  # gone in 0.5.23
SAMPLING_KEYS = (
    "speculative_accept_threshold_single", "speculative_accept_threshold_acc", "speculative_use_rejection_sampling",
    "speculative_use_block_verification",
)  # fmt: skip


class VersionError(ValueError):
    """A server command the named SGLang version refuses, or a version the product does not support."""


@dataclass(frozen=True)
class Version:
    name: str
    checked: str  # how this product knows it works: "live on a GPU" or "by its rules"
    aux_capture: bool  # --enable-return-aux-hidden-states (aux layers without a draft model)
    meta_keys: tuple[str, ...]  # spec_* keys of a finished speculative request

    @property
    def options(self) -> dict[str, dict]:
        return _options(self.name)


VERSIONS = {
    "0.5.17": Version("0.5.17", "live on a GPU", False, SPEC_META_KEYS + SPEC_META_KEYS_REMOVED),
    "0.5.23": Version("0.5.23", "by its rules", True, SPEC_META_KEYS),
}


def get(name: str) -> Version:
    if name not in VERSIONS:
        raise VersionError(f"SGLang {name}: not supported (supported: {', '.join(SUPPORTED)})")
    return VERSIONS[name]


def nearest(version: tuple[int, ...]) -> Version | None:
    """The supported version a running server's (major, minor, patch) is, else None."""
    return VERSIONS.get(".".join(map(str, version[:3])))


@cache
def _options(name: str) -> dict[str, dict]:
    return json.loads((Path(__file__).parent / "sglang-cli" / f"{name}.json").read_text())["options"]


_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _match(options: dict, flag: str, v: str) -> str:
    """The option argparse takes `flag` for: exact, else the one it abbreviates."""
    if flag in options:
        return flag
    hits = sorted(o for o in options if o.startswith(flag))
    if len(hits) == 1:
        return hits[0]
    if hits:
        raise VersionError(f"SGLang {v} refuses {flag}: ambiguous option: {flag} could match {', '.join(hits)}")
    raise VersionError(f"SGLang {v} refuses {flag}: unrecognized arguments: {flag}")


def parse(name: str, args: list[str]) -> dict[str, list[str] | bool]:
    """The server args (dest -> values, or True for a switch) as `name`'s parser reads `args`; VersionError on a flag
    it refuses (unknown, ambiguous, a value missing or outside its choices)."""
    v, options = get(name).name, _options(name)
    out: dict[str, list[str] | bool] = {}
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--"):
            raise VersionError(f"SGLang {v} refuses {tok}: unrecognized arguments: {tok}")
        flag, eq, inline = tok.partition("=")
        spec = options[_match(options, flag, v)]
        nargs, i = spec["nargs"], i + 1
        if eq:
            values = [inline]
        else:
            take = {0: 0, 1: 1, "?": 1, "*": None, "+": None}.get(nargs, nargs)
            values = []
            while i < len(args) and (take is None or len(values) < take):
                if args[i].startswith("-") and not _NUMBER.match(args[i]):
                    break
                values.append(args[i])
                i += 1
        if nargs == 0 and values:
            raise VersionError(f"SGLang {v} refuses {flag}: ignored explicit argument {values[0]!r}")
        if (nargs == 1 or nargs == "+" or isinstance(nargs, int) and nargs > 1) and not values:
            raise VersionError(f"SGLang {v} refuses {flag}: expected at least one argument")
        for x in values:
            if "choices" in spec and x not in spec["choices"]:
                raise VersionError(
                    f"SGLang {v} refuses {flag} {x}: invalid choice (choose from {', '.join(spec['choices'])})"
                )
        out[spec["dest"]] = True if nargs == 0 else values
    return out


def check_args(name: str, args: list[str]) -> dict:
    """`args` (the server's command line after `python -m sglang.launch_server`) as `name` parses them, after its
    launch checks; VersionError names the version and the flag it refuses."""
    ver = get(name)
    a = parse(name, args)
    one = {k: (x[0] if isinstance(x, list) and len(x) == 1 else x) for k, x in a.items()}
    if ver.aux_capture and a.get("enable_return_aux_hidden_states"):
        method = str(one.get("speculative_algorithm") or "").upper()
        if method not in AUX_CAPTURE_METHODS:
            raise VersionError(
                f"SGLang {name} refuses --enable-return-aux-hidden-states without --speculative-algorithm "
                f"{', '.join(AUX_CAPTURE_METHODS)} naming the capture convention"
            )
        if "speculative_draft_model_path" in a:
            raise VersionError(
                f"SGLang {name} refuses --speculative-draft-model-path beside --enable-return-aux-hidden-states "
                "(aux capture runs without a draft)"
            )
        if int(one.get("pp_size") or 1) != 1:
            raise VersionError(f"SGLang {name} refuses --enable-return-aux-hidden-states with --pp-size != 1")
        ids = a.get("return_aux_hidden_state_layer_ids")
        if method != "EAGLE3" and not ids:
            raise VersionError(
                f"SGLang {name} refuses {method} aux capture without --return-aux-hidden-state-layer-ids"
            )
        if ids is not None:
            n = [int(x) for x in ids]
            if any(x < 0 for x in n) or len(set(n)) != len(n):
                raise VersionError(
                    f"SGLang {name} refuses --return-aux-hidden-state-layer-ids {' '.join(ids)}: non-negative, "
                    "no repeats"
                )
    elif "return_aux_hidden_state_layer_ids" in a:
        raise VersionError(
            f"SGLang {name} refuses --return-aux-hidden-state-layer-ids without --enable-return-aux-hidden-states"
        )
    return a


def server_args_after(launch_cmd: list[str], argv: list[str]) -> list[str]:
    """The server's own args in `argv` (python, then the launch command, then the args)."""
    n = 1 + len(launch_cmd)
    return list(argv[n:])


def correct_drafts_histogram(meta: dict) -> list[int] | None:
    """Verify steps by drafts accepted, from a finished request's meta_info: 0.5.23's only key, 0.5.17's old twin."""
    return meta.get("spec_correct_drafts_histogram") or meta.get("spec_accept_histogram")


def sampling_settings(raw_server_info: dict) -> dict:
    """The settings that move τ in sampled verification, as a server reports them (None: not reported). A DFLASH
    server verifies target-only (its draft a point mass: 0.5.17 ``srt/speculative/dflash_utils.py``
    ``compute_dflash_sampling_correct_drafts_and_bonus``), reading only the two accept thresholds; rejection sampling is
    EAGLE/EAGLE3's alone (``srt/arg_groups/speculative_hook.py:609-620``)."""
    if raw_server_info.get("speculative_algorithm") == "DFLASH":
        return {"verify": "target_only", **{k: raw_server_info.get(k) for k in SAMPLING_KEYS[:2]}}
    return {k: raw_server_info.get(k) for k in SAMPLING_KEYS}
