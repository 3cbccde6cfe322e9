"""Each supported SGLang version held to its own rules: the flags its parser takes, the launch checks it runs, the
meta_info keys it sends; every server command the product builds passes the version it is built for."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from eagle3ft.config import REPO_ROOT, load_config
from eagle3ft.targets import sglang_versions as sv
from eagle3ft.targets.sglang_server import LaunchError, build_command

sys.path.insert(0, str(Path(__file__).parent))
import sglang_double  # noqa: E402

REAL = json.loads((Path(__file__).parent / "fixtures/sglang-real-parsers.json").read_text())["verdicts"]
CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))


def _refused_flag(message: str) -> str:
    return message.split(" refuses ", 1)[1].split(":")[0].split()[0]


@pytest.mark.parametrize("version", sv.SUPPORTED)
def test_the_recorded_parser_agrees_with_each_real_parser(version):
    """The real parsers' and launch checks' verdicts (benchmarks/sglang_cli_options.py --check, run on each wheel)
    on the product's commands and on the cases each version refuses: the recorded options give the same verdicts,
    and each refusal names a flag the real message names."""
    assert REAL[version], "no recorded verdicts"
    for row in REAL[version]:
        try:
            sv.check_args(version, row["argv"])
            ok, message = True, ""
        except sv.VersionError as e:
            ok, message = False, str(e)
        assert ok == row["ok"], (row["argv"], message, row.get("message"))
        if not ok:
            assert message.startswith(f"SGLang {version} refuses ") and "\n" not in message
            assert _refused_flag(message) in row["message"], (message, row["message"])


def test_the_flags_each_version_refuses():
    old = ["--model-path", "m", "--cuda-graph-max-bs", "64"]
    assert sv.parse("0.5.17", old)["cuda_graph_max_bs_decode"] == ["64"]  # 0.5.17's deprecated alias
    with pytest.raises(sv.VersionError, match=r"^SGLang 0\.5\.23 refuses --cuda-graph-max-bs: ambiguous option"):
        sv.check_args("0.5.23", old)
    for v in sv.SUPPORTED:
        assert sv.parse(v, ["--cuda-graph-max-bs-decode", "64"]) == {"cuda_graph_max_bs_decode": ["64"]}
    with pytest.raises(sv.VersionError, match=r"0\.5\.23 refuses --cuda-graph-backend-prefill tc_piecewise"):
        sv.check_args("0.5.23", ["--cuda-graph-backend-prefill", "tc_piecewise"])
    with pytest.raises(sv.VersionError, match="not supported"):
        sv.get("0.5.20")


def test_aux_capture_follows_0_5_23s_launch_check():
    ids = ["--return-aux-hidden-state-layer-ids", "2", "30", "58"]
    with pytest.raises(sv.VersionError, match=r"^SGLang 0\.5\.23 refuses --enable-return-aux-hidden-states without"):
        sv.check_args("0.5.23", ["--enable-return-aux-hidden-states", *ids])
    with pytest.raises(sv.VersionError, match="--speculative-draft-model-path beside"):
        sv.check_args(
            "0.5.23",
            [
                "--speculative-algorithm",
                "EAGLE3",
                "--speculative-draft-model-path",
                "d",
                "--enable-return-aux-hidden-states",
            ],
        )
    with pytest.raises(sv.VersionError, match="pp-size"):
        sv.check_args(
            "0.5.23", ["--speculative-algorithm", "EAGLE3", "--enable-return-aux-hidden-states", "--pp-size", "2"]
        )
    with pytest.raises(sv.VersionError, match="without --enable-return-aux-hidden-states"):
        sv.check_args("0.5.23", ids)
    with pytest.raises(sv.VersionError, match=r"^SGLang 0\.5\.17 refuses --enable-return-aux-hidden-states"):
        sv.check_args("0.5.17", ["--speculative-algorithm", "EAGLE3", "--enable-return-aux-hidden-states", *ids])
    got = sv.check_args("0.5.23", ["--speculative-algorithm", "EAGLE3", "--enable-return-aux-hidden-states", *ids])
    assert got["return_aux_hidden_state_layer_ids"] == ["2", "30", "58"]


def _draft_for(cfg, tmp_path: Path) -> Path:
    d = tmp_path / "draft"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text((REPO_ROOT / cfg.drafter.config).read_text())
    return d


@pytest.mark.parametrize("version", sv.SUPPORTED)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_builds_commands_its_version_takes(config, version, tmp_path):
    """Harvest (both capture routes where the version has them), baseline and speculative commands of every config
    pass the version's flags and launch checks (build_command raises otherwise)."""
    cfg = load_config(config)
    cfg.serve.model_path = cfg.serve.model_path or "/models/target"
    cfg.serve.sglang_version = version
    draft = _draft_for(cfg, tmp_path)
    build_command(cfg, "baseline")
    build_command(cfg, "speculative", drafter=draft)
    cfg.serve.harvest_capture = "eagle3"
    build_command(cfg, "harvest", drafter=draft)
    cfg.serve.harvest_capture = "aux_flag"
    if get_aux(version):
        argv = build_command(cfg, "harvest").argv
        assert (
            argv[argv.index("--speculative-algorithm") + 1] == "EAGLE3" and "--speculative-draft-model-path" not in argv
        )
    else:
        with pytest.raises(
            LaunchError, match=f"^SGLang {re.escape(version)} refuses --enable-return-aux-hidden-states"
        ):
            build_command(cfg, "harvest")


def get_aux(version: str) -> bool:
    return sv.get(version).aux_capture


def test_a_refused_flag_stops_the_launch_with_one_line():
    cfg = load_config(REPO_ROOT / "configs/kimi-k25-8gpu.yaml")
    cfg.serve.sglang_version = "0.5.23"
    cfg.serve.extra_args = ["--cuda-graph-max-bs", "64"]
    with pytest.raises(LaunchError) as e:
        build_command(cfg, "baseline")
    assert str(e.value) == (
        "SGLang 0.5.23 refuses --cuda-graph-max-bs: ambiguous option: --cuda-graph-max-bs could match "
        "--cuda-graph-max-bs-decode, --cuda-graph-max-bs-prefill (serve.sglang_version 0.5.23)"
    )


def test_the_harvest_servers_running_requests_cover_its_concurrency(tmp_path):
    """An EAGLE3 server runs at most 48 requests unless told; the K2.5 harvest sends 64 per server."""
    cfg = load_config(REPO_ROOT / "configs/kimi-k25-8gpu.yaml")
    draft = _draft_for(cfg, tmp_path)
    argv = build_command(cfg, "harvest", drafter=draft).argv
    assert argv[argv.index("--max-running-requests") + 1] == "64" == str(cfg.harvest.sglang.concurrency)
    cfg.harvest.sglang.concurrency = 32
    assert "--max-running-requests" not in build_command(cfg, "harvest", drafter=draft).argv
    cfg.harvest.sglang.concurrency = 100
    cfg.serve.extra_args = ["--max-running-requests", "128"]
    assert build_command(cfg, "harvest", drafter=draft).argv.count("--max-running-requests") == 1  # the user's own
    cfg.serve.extra_args, cfg.bench.concurrency = [], [1, 64]
    argv = build_command(cfg, "speculative", drafter=draft).argv
    assert argv[argv.index("--max-running-requests") + 1] == "64"
    assert "--max-running-requests" not in build_command(cfg, "baseline").argv


@pytest.mark.parametrize("name", ["configs/kimi-k25-8gpu.yaml", "configs/kimi-k2-rehearsal.yaml"])
def test_the_flagship_configs_extra_args_pass_both_versions(name):
    for v in sv.SUPPORTED:
        sv.check_args(v, list(load_config(REPO_ROOT / name).serve.extra_args))


SCRIPTS = sorted(
    [
        *(REPO_ROOT / "launch").glob("*.sh"),
        *(REPO_ROOT / "benchmarks/leases").rglob("*.sh"),
        REPO_ROOT / "docs/sglang.md",
    ]
)


def _takes(version: str, flag: str) -> bool:
    try:
        sv.parse(version, [flag] if sv.get(version).options.get(flag, {"nargs": 1})["nargs"] == 0 else [flag, "1"])
        return True
    except sv.VersionError as e:
        return "choice" in str(e) or "ignored explicit" in str(e)  # the flag itself was taken


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_launch_scripts_and_lease_plans_pass_no_flag_0_5_23_refuses(path):
    """Every SGLang flag in the launch scripts, lease plans and docs (each --flag 0.5.17's parser takes) is one
    0.5.23's parser takes too, so a server started from them on either version does not stop at its parser."""
    text = path.read_text()
    if path.suffix == ".md":  # the versions section names the flags 0.5.23 refuses, as refused
        head, _, rest = text.partition("### Supported SGLang versions")
        text = head + rest[rest.find("\n### ") :]
    flags = sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", text)))
    refused = [f for f in flags if _takes("0.5.17", f) and not _takes("0.5.23", f)]
    assert refused == []


def test_the_0_5_23_double_refuses_what_0_5_23_refuses(capsys, monkeypatch):
    """The double plays 0.5.23's parser and launch check (before any model loads): the aux flag alone, and the
    flag 0.5.23 finds ambiguous."""
    monkeypatch.delenv("SGLANG_DOUBLE_VERSION", raising=False)
    base = ["--double-version", "0.5.23", "--model-path", "/nonexistent", "--enable-return-hidden-states"]
    for extra, said in [
        (
            ["--enable-return-aux-hidden-states", "--return-aux-hidden-state-layer-ids", "0", "1", "2"],
            "--enable-return-aux-hidden-states needs --speculative-algorithm EAGLE3",
        ),
        (
            [
                "--speculative-algorithm",
                "EAGLE3",
                "--speculative-draft-model-path",
                "/d",
                "--enable-return-aux-hidden-states",
            ],
            "captures without a draft",
        ),
        (["--cuda-graph-max-bs", "8"], "ambiguous option: --cuda-graph-max-bs could match"),
    ]:
        with pytest.raises(SystemExit) as e:
            sglang_double.main(base + extra)
        assert e.value.code == 2 and said in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        sglang_double.main(["--model-path", "/nonexistent", "--enable-return-aux-hidden-states"])  # 0.5.17
    assert e.value.code == 2 and "unrecognized arguments: --enable-return-aux-hidden-states" in capsys.readouterr().err
