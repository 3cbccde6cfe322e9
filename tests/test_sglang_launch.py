"""The SGLang launcher: flags from the config, start/health/stop, and the Kimi-K2.5 flagship without a GPU."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import yaml

from eagle3ft.config import REPO_ROOT, ConfigError, load_config, to_dict
from eagle3ft.data.chat import TEMPLATES
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.setting import Setting
from eagle3ft.targets.sglang import target_identity
from eagle3ft.targets.sglang_server import LaunchError, build_command, health, main, server_for

KIMI = REPO_ROOT / "configs/kimi-k25-8gpu.yaml"
DOUBLE = Path(__file__).parent / "sglang_double.py"


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def kimi_draft(tmp_path: Path, ids=None) -> Path:
    """A folder standing in for the AQ-MedAI download: its documented config.json (weights are not read)."""
    d = tmp_path / "Kimi-K2-Instruct-eagle3"
    d.mkdir()
    raw = json.loads((REPO_ROOT / "configs/drafters/kimi-k2.json").read_text())
    if ids is not None:
        raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
    (d / "config.json").write_text(json.dumps(raw))
    return d


def test_kimi_flagship_validates_without_a_gpu(tmp_path):
    cfg = load_config(KIMI)
    spec = DrafterConfig.from_json(REPO_ROOT / cfg.drafter.config)
    hidden, vocab, layers = target_identity(cfg.target, cfg.harvest.sglang)
    assert (hidden, vocab, layers) == (7168, 163840, 61)
    assert spec.check_target(hidden, vocab, layers) == [2, 30, 58]
    assert cfg.target.chat_template in TEMPLATES and cfg.harvest.backend == "sglang" and cfg.bench.backend == "sglang"

    base = build_command(cfg, "baseline")
    assert (
        flag(base.argv, "--tp-size") == "8"
        and "--trust-remote-code" in base.argv
        and "--speculative-algorithm" not in base.argv
    )
    assert flag(base.argv, "--model-path") == "/models/Kimi-K2.5" and base.env["NCCL_DEBUG"] == "WARN"

    spec_cmd = build_command(cfg, "speculative", port=30001, drafter=tmp_path / "export", setting=cfg.bench.settings[0])
    assert [
        flag(spec_cmd.argv, f"--speculative-{n}") for n in ("algorithm", "num-steps", "eagle-topk", "num-draft-tokens")
    ] == ["EAGLE3", "3", "1", "4"]
    assert spec_cmd.url == "http://127.0.0.1:30001" and "--enable-return-hidden-states" not in spec_cmd.argv

    harvest = build_command(cfg, "harvest", drafter=kimi_draft(tmp_path))
    assert "--enable-return-hidden-states" in harvest.argv and harvest.env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert (
        flag(harvest.argv, "--speculative-num-draft-tokens") == "2"
        and flag(harvest.argv, "--cuda-graph-max-bs-decode") == "64"
    )


def test_harvest_draft_must_capture_the_drafters_layers(tmp_path):
    cfg = load_config(KIMI)
    with pytest.raises(LaunchError, match=r"captures layers \[1, 29, 57\].*needs \[2, 30, 58\]"):
        build_command(cfg, "harvest", drafter=kimi_draft(tmp_path, ids=[1, 29, 57]))
    cfg.drafter.init = None
    with pytest.raises(LaunchError, match="needs a draft model folder"):
        build_command(cfg, "harvest")
    cfg.serve.harvest_capture = "aux_flag"
    with pytest.raises(LaunchError, match=r"^SGLang 0\.5\.17 refuses --enable-return-aux-hidden-states"):
        build_command(cfg, "harvest")  # 0.5.17 has no aux capture without a draft
    cfg.serve.sglang_version = "0.5.23"
    argv = build_command(cfg, "harvest").argv
    i = argv.index("--enable-return-aux-hidden-states")
    assert argv[i + 1 : i + 5] == ["--return-aux-hidden-state-layer-ids", "2", "30", "58"]  # the ids unchanged
    assert flag(argv, "--speculative-algorithm") == "EAGLE3" and "--speculative-draft-model-path" not in argv
    assert "--max-running-requests" not in argv  # no draft, no cap of 48


def test_settings_sglang_refuses_are_refused():
    cfg = load_config(KIMI)
    assert Setting.parse("5/1/6") == Setting(5, 1, 6) and Setting.of("5/1/6").key == "5/1/6"
    with pytest.raises(LaunchError, match="at most steps \\+ 1"):
        build_command(cfg, "speculative", drafter="/x", setting=Setting(3, 1, 5))
    with pytest.raises(ConfigError, match="steps/topk/num_draft_tokens"):
        Setting.parse("3-1-4")
    with pytest.raises(ConfigError, match="Setting.steps must be positive"):
        Setting.parse("0/1/4")
    cfg.serve.model_path = None
    with pytest.raises(LaunchError, match="serve.model_path"):
        build_command(cfg, "baseline")


def test_target_identity_from_the_model_folder(tmp_path):
    cfg = load_config(KIMI)
    cfg.harvest.sglang.hidden_size = None
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["KimiK25ForConditionalGeneration"],
                "text_config": {"hidden_size": 7168, "vocab_size": 163840, "num_hidden_layers": 61},
            }
        )
    )
    cfg.target.path = str(tmp_path)
    assert target_identity(cfg.target, cfg.harvest.sglang) == (7168, 163840, 61)
    cfg.target.path = str(tmp_path / "absent")
    with pytest.raises(RuntimeError, match="set harvest.sglang.hidden_size"):
        target_identity(cfg.target, cfg.harvest.sglang)


def test_print_shows_the_command(tmp_path, capsys):
    main(
        [
            "--config",
            str(KIMI),
            "--run-dir",
            str(tmp_path),
            "--role",
            "speculative",
            "--drafter",
            "/d",
            "--setting",
            "2/1/3",
            "--print",
        ]
    )
    out = capsys.readouterr().out
    assert "NCCL_DEBUG=WARN" in out and "--speculative-num-draft-tokens 3" in out and "--tp-size 8" in out


def _double_config(tmp_path: Path, extra: list[str]):
    cfg = load_config(REPO_ROOT / "configs/tiny.yaml")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg.serve.python = sys.executable
    cfg.serve.launch_cmd = [str(DOUBLE)]
    cfg.serve.model_path = str(tmp_path / "model")
    cfg.serve.port = port
    cfg.serve.harvest_capture = "aux_flag"
    cfg.serve.sglang_version = "0.5.23"
    cfg.serve.env = {"SGLANG_DOUBLE_CONFIG": str(REPO_ROOT / "configs/tiny.yaml"), "SGLANG_DOUBLE_VERSION": "0.5.23"}
    cfg.serve.extra_args = extra
    cfg.serve.startup_timeout_s = 120.0
    cfg.serve.stop_grace_s = 10.0
    return cfg


@pytest.mark.slow
def test_launch_run_a_command_against_the_server_then_stop_it(tmp_path):
    """The launcher runs the double as it would run SGLang (same flags, /health, SIGTERM to the group),
    runs a command against it (the harvest recipe's form) and passes on the command's status."""
    cfg = _double_config(tmp_path, [])
    config = tmp_path / "double.yaml"
    config.write_text(yaml.safe_dump(to_dict(cfg)))
    url = f"http://127.0.0.1:{cfg.serve.port}"
    probe = (
        "import json, sys, urllib.request; open(sys.argv[1], 'w').write(urllib.request.urlopen(sys.argv[2] + "
        "'/server_info').read().decode()); sys.exit(3)"
    )
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "--config",
                str(config),
                "--run-dir",
                str(tmp_path),
                "--role",
                "harvest",
                "--",
                sys.executable,
                "-c",
                probe,
                str(tmp_path / "info.json"),
                url,
            ]
        )
    assert exit_.value.code == 3  # the command's status
    info = json.loads((tmp_path / "info.json").read_text())
    assert (
        info["return_aux_hidden_state_layer_ids"] == [0, 1, 2]
        and info["version"] == "0.5.23"
        and info["model_path"] == cfg.serve.model_path
    )
    assert not health(url, 1.0)  # stopped
    log = next((tmp_path / "serve").glob("harvest-*.log")).read_text()
    assert (
        "--speculative-algorithm EAGLE3 --enable-return-aux-hidden-states --return-aux-hidden-state-layer-ids 0 1 2"
        in log
    )
    assert info["speculative_algorithm"] is None and info["enable_return_aux_hidden_states"]  # as 0.5.23 reports it


def test_a_server_that_dies_at_start_is_reported_with_its_log(tmp_path):
    with pytest.raises(LaunchError, match=r"^SGLang 0\.5\.23 refuses --no-such-flag: unrecognized arguments"):
        server_for(_double_config(tmp_path, ["--no-such-flag"]), tmp_path, "baseline")  # stopped before launch
    cfg = _double_config(tmp_path, ["--enable-lora"])  # SGLang takes it, the double does not mirror it
    with pytest.raises(
        LaunchError, match="(?s)exited with 2 before answering /health.*unrecognized arguments: --enable-lora"
    ):
        with server_for(cfg, tmp_path, "baseline"):
            pass
