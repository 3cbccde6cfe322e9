"""benchmarks/leases/dflash_vs_eagle3_live.sh, the DFlash lease plan, on the CPU where it needs no SGLang: its regen (through
the embedded backend instead of the plain servers), harvest and train steps on the tiny target with the tiny DFlash
drafter, through the plan's own command lines; a rerun skips the steps done, and a second lease resumes from what
`wait` packed."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3ft.config import REPO_ROOT
from eagle3ft.data.prompts import mtbench_path
from eagle3ft.data.store import FeatureStore
from eagle3ft.drafter import dflash_export

sys.path.insert(0, str(Path(__file__).parent))
from free_ports import free_ports  # noqa: E402

PLAN = "benchmarks/leases/dflash_vs_eagle3_live.sh"


def plan(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", PLAN, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)


def cpu_env(tmp_path: Path, **extra: str) -> dict:
    """The plan's environment for the tiny target on this CPU: C holds MT-Bench and three ShareGPT conversations."""
    c = tmp_path / "c"
    c.mkdir()
    shutil.copy(mtbench_path(), c / "mtbench-questions.jsonl")
    turns = ["Name three rivers of Europe.", "Write a haiku about rain.", "What is a prime number?"]
    (c / "sharegpt-conversations.jsonl").write_text(
        "".join(
            json.dumps({"id": f"s{k}", "messages": [{"role": "user", "content": t}]}) + "\n"
            for k, t in enumerate(turns)
        )
    )
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PY": sys.executable,
        "C": str(c),
        "L": str(tmp_path / "L"),
        "S": str(tmp_path / "S"),
        "MODEL": "",  # the config's own (tiny) target
        "DEVICE": "cpu",
        "CONFIG": "configs/tiny.yaml",
        "DFLASH": "configs/drafters/tiny-dflash.json",
        "REGEN_BACKEND": "hf",
        "REGEN_S": "0",
        "NEW": "8",
        "MTB_LIMIT": "4",
        "AUX_DTYPE": "fp8",
        "ACCEL": "configs/accelerate/cpu-2proc.yaml",
        "NPROC": "1",
        "TRAIN_STEPS": "2",
        "PORT": str(free_ports(1)),
        **extra,
    }


@pytest.mark.slow
def test_the_plans_regen_harvest_and_train_run_on_the_tiny_target(tmp_path):
    env = cpu_env(tmp_path)
    done = plan({**env, "STEPS": "regen harvest train"}, "run")
    log = done.stdout + done.stderr
    assert done.returncode == 0 and "dflash exit 0" in log, log
    for step in ("regen", "harvest", "train"):
        assert (tmp_path / "L" / f"done.{step}").is_file(), log
    S = tmp_path / "S"
    for seed in (0, 1):  # one token store per sampling seed, both harvested
        assert (S / f"regen{seed}" / "tokens" / "manifest.json").is_file()
    summary = json.loads((tmp_path / "L" / "harvest-feat.json").read_text())
    assert summary["samples"]["train"] == 2 * 3 and summary["samples"]["heldout"] == 2 * 4, summary
    store = FeatureStore(S / "feat" / "features")
    assert store.target["capture"] == {"kind": "dflash", "hidden_states": [1, 2, 3]}
    assert store.manifest["aux_dtype"] == "fp8"
    export = S / "dflash" / "export"
    drafter = dflash_export.load(export)
    assert drafter.config.block_size == 4 and drafter.config.target_layer_ids == [0, 1, 2]

    again = plan({**env, "STEPS": "regen harvest train"}, "run")  # a second start on the same machine goes on
    assert again.returncode == 0 and all(
        f"step {s}: done before" in again.stdout for s in ("regen", "harvest", "train")
    )

    out = tmp_path / "out"  # the first lease packs the export; a fresh machine resumes from it
    out.mkdir()
    packed = plan({**env, "OUT": str(out)}, "wait", "0")
    assert packed.returncode == 0 and (out / "dflash-export" / "config.json").is_file(), packed.stdout + packed.stderr
    (tmp_path / "second").mkdir()
    fresh = cpu_env(tmp_path / "second")
    resumed = plan(fresh, "resume", str(out / "dflash-export"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    back = Path(fresh["S"]) / "dflash" / "export" / "model.safetensors"
    best = S / "dflash" / "export-best"  # what the plan serves: the best export by held-out tau, else the last
    served = best if (best / "config.json").is_file() else export
    assert back.read_bytes() == (served / "model.safetensors").read_bytes()
    skipped = plan({**fresh, "STEPS": "regen layers harvest train"}, "run")
    assert all(f"step {s}: done before" in skipped.stdout for s in ("regen", "layers", "harvest", "train")), (
        skipped.stdout
    )
