"""The console commands `pip install -e .` puts beside the interpreter ([project.scripts]): `eagle3ft` lists every
stage and each `eagle3ft STAGE` (and `eagle3ft-STAGE`) answers --help with that stage's own options; eagle3ft-train is
`accelerate launch ... train/finetune.py` (docs/pipeline.md) with no path into the tree."""

import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
COMMANDS = ["regen", "harvest", "magpie", "train", "eval", "bench", "report", "economics", "compare"]


@pytest.mark.parametrize("name", COMMANDS)
def test_each_command_is_installed_and_answers_help(name):
    exe = BIN / f"eagle3ft-{name}"
    assert exe.is_file(), f"{exe}: not installed (pip install -e .)"
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--config" in r.stdout and "--run-dir" in r.stdout
    assert r.stdout.startswith(f"usage: eagle3ft {name} "), r.stdout[:200]  # an alias of `eagle3ft STAGE`


def test_eagle3ft_lists_every_stage_and_each_answers_its_own_help():
    from eagle3ft.commands import COMMANDS as STAGES

    # every eagle3ft-STAGE script is a subcommand; sglang-check reads a running server, not a run folder
    assert set(STAGES) == set(COMMANDS) | {"sglang-check"}
    r = subprocess.run([str(BIN / "eagle3ft"), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and all(f"  {name} " in r.stdout for name in STAGES), r.stdout
    for name in STAGES:
        r = subprocess.run([str(BIN / "eagle3ft"), name, "--help"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith(f"usage: eagle3ft {name} "), (name, r.stdout, r.stderr[-2000:])
    r = subprocess.run([str(BIN / "eagle3ft"), "nope"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "eagle3ft: error: unknown stage 'nope'" in r.stderr


def test_eagle3ft_train_launches_two_ranks_and_stops_on_an_empty_run_folder_in_one_line(tmp_path):
    run = tmp_path / "empty"
    run.mkdir()
    cmd = [str(BIN / "eagle3ft-train"), "--accelerate-config", "configs/accelerate/cpu-2proc.yaml"]
    cmd += [
        "--config",
        str(REPO / "configs/tiny.yaml"),
        "--run-dir",
        str(run),
        "--set",
        "train.logging.wandb_mode=disabled",
    ]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path
    )  # not from the checkout: the accelerate config is found in it
    errors = [line for line in r.stderr.splitlines() if ": error:" in line]
    assert r.returncode != 0 and len(errors) == 1, r.stderr[-3000:]
    assert "finetune" in errors[0] and "features" in errors[0], errors


def test_importing_a_data_stage_leaves_the_environment_alone():
    """OMP_WAIT_POLICY is set by the command that runs a stage (eagle3ft/commands.py, or the module run as a script),
    not by importing its module."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import os, eagle3ft.data.harvest, eagle3ft.data.magpie, eagle3ft.data.regen; print(os.environ.get('OMP_WAIT_POLICY'))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "None", (r.stdout, r.stderr[-2000:])
