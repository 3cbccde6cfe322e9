"""Training as an operator and an attacker would run it: --overwrite removes only what the trainer wrote, and only in
a run folder; a refused start changes nothing; a resume runs this config's rates; checkpoints carry checksums;
refusals are one line under any launcher; a diverging loss is named."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from train_fixtures import REPO, launch, write_store

import eagle3ft.train.finetune as finetune
from eagle3ft.config import load_config
from eagle3ft.train.checkpoint import FORMAT

TINY = REPO / "configs/tiny.yaml"


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def started_training(calls: list):
    """A stand-in for train/loop.py's run_training that passes every check at once: on_start runs, nothing trains."""

    def run_training(cfg, run_dir, on_start=None):
        calls.append(run_dir)
        if on_start is not None:
            on_start(None)
        return {}

    return run_training


def finetune_cli(run_dir: Path, *extra: str) -> None:
    finetune.main(
        ["--config", str(TINY), "--run-dir", str(run_dir), "--set", "train.logging.wandb_mode=disabled", *extra]
    )


def test_overwrite_refuses_a_folder_that_is_no_run_and_removes_nothing(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(finetune, "run_training", started_training(calls))
    checkout = tmp_path / "checkout"  # what a checkout looks like: the train/ package, a user's export/
    for name, text in {
        "pyproject.toml": "[project]\n",
        "train/__init__.py": "",
        "train/loop.py": "x = 1\n",
        "train/metrics.py": "y = 2\n",
        "export/notes.txt": "mine\n",
        "export/card.json": '{"which": "last"}',
    }.items():
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text(text)
    before = tree(checkout)
    with pytest.raises(SystemExit) as e:
        finetune_cli(checkout, "--overwrite")
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0] == (
        f"finetune.py: error: --overwrite: {checkout} is not a run folder (no config.yaml of a stage, no "
        "features/manifest.json, no ckpt/step-N of the trainer), so nothing in it is removed; give the folder a "
        "harvest wrote to"
    )
    assert "training run" not in err[0] and "with --overwrite" not in err[0]
    assert tree(checkout) == before and calls == []

    finetune_cli(checkout)  # without --overwrite: no refusal that calls it a training run; the loop names what lacks
    assert calls == [checkout] and "already holds" not in capsys.readouterr().err
    assert {k: v for k, v in tree(checkout).items() if k != "config.yaml"} == before


def test_overwrite_removes_only_what_the_trainer_wrote(tmp_path, monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(finetune, "run_training", started_training(calls))
    run = tmp_path / "run"
    write_store(run, n_train=2, n_heldout=1)
    trainer = {
        "ckpt/step-2/trainer_state.json": json.dumps({"format": FORMAT, "step": 2}),
        "ckpt/step-2/model.safetensors": "w",
        "ckpt/.step-4.tmp/config.json": "{}",
        "export/card.json": json.dumps({"which": "last", "step": 2}),
        "export/model.safetensors": "w",
        "export-best/card.json": json.dumps({"which": "best", "step": 2}),
        ".export.old/model.safetensors": "w",
        "train/metrics.jsonl": '{"step": 1}\n',
        "train/data.json": "{}",
        "train/wandb/run.log": "",
    }
    users = {
        "ckpt/README": "my notes on these checkpoints\n",
        "ckpt/step-9/weights.bin": "not the trainer's: no trainer_state.json",
        "train/notes.txt": "mine\n",
        "train/__init__.py": "",
        "export-sglang/card.json": json.dumps({"which": "last"}),
    }
    for name, text in {**trainer, **users}.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    with pytest.raises(SystemExit) as e:
        finetune_cli(run)
    assert e.value.code == 2 and calls == []
    listed = "ckpt/step-2, ckpt/.step-4.tmp, export, .export.old, export-best, train/metrics.jsonl, train/data.json, "
    listed += "train/wandb"
    assert capsys.readouterr().err.strip() == (
        f"finetune.py: error: {run} already holds a training run ({listed}); continue it with --resume auto, or start "
        "over in a new --run-dir or with --overwrite (removes those first)"
    )
    finetune_cli(run, "--overwrite")
    assert f"--overwrite: removed {listed} of {run}" in capsys.readouterr().err
    left = {k for k, v in tree(run).items() if v is not None}
    assert {k for k in users} <= left and not {k for k in trainer} & left
    assert (run / "features" / "manifest.json").is_file() and (run / "vocab.safetensors").is_file()
    assert "train" in yaml.safe_load((run / "config.yaml").read_text())["stages"]


# --------------------------------------------------------------------------- checkpoints carry checksums


class SavingDist:
    """What save_checkpoint asks of train/dist.py's Dist, on one process: whole tensors at once."""

    is_main = True

    def training_state(self):
        return {"fp32.w": torch.arange(4096, dtype=torch.float32)}, {"optimizer": {"step": 1}}

    def full_state_dict(self, module):
        return {f"drafter.{k}": v for k, v in module.state_dict().items()}

    def barrier(self) -> None:
        pass


def tiny_drafter():
    from eagle3ft.drafter.config import DrafterConfig
    from eagle3ft.drafter.model import Eagle3Drafter

    torch.manual_seed(0)
    return Eagle3Drafter(DrafterConfig.from_json(REPO / "configs/drafters/tiny.json"))


def save_steps(run: Path, *steps: int) -> None:
    from eagle3ft.train.checkpoint import save_checkpoint

    model = tiny_drafter()
    for step in steps:
        save_checkpoint(SavingDist(), model, model.config, run, step, {"step": step, "last": {"loss": 1.0}}, keep=0)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # inside the tensor data: the header still parses
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damaged", ["state.safetensors", "model.safetensors", "state.json"])
def test_resume_auto_passes_over_a_checkpoint_whose_file_fails_its_checksum(tmp_path, damaged):
    from eagle3ft.train.checkpoint import CheckpointError, choose_resume, verify_checkpoint

    save_steps(tmp_path, 2, 4)
    newest = tmp_path / "ckpt" / "step-4"
    assert set(json.loads((newest / "trainer_state.json").read_text())["sha256"]) == {
        "config.json",
        "model.safetensors",
        "state.json",
        "state.safetensors",
    }
    if damaged == "state.json":
        (newest / damaged).write_text((newest / damaged).read_text().replace('"step": 1', '"step": 7'))
    else:
        flip_a_byte(newest / damaged)
    why = f"{newest / damaged}: fails its sha256 check (damaged after it was written)"
    assert choose_resume(tmp_path, "auto") == (tmp_path / "ckpt" / "step-2", [why])
    with pytest.raises(CheckpointError, match=re.escape(why)):
        verify_checkpoint(newest)  # a named --resume loads through it too (load_checkpoint)


# --------------------------------------------------------------------------- real launches on one process

BASE = (
    "train.schedule.max_steps=4",
    "train.checkpoint.save_every=1",
    "train.checkpoint.keep_checkpoints=0",
    "train.objective.ttt_steps=2",
    "train.schedule.warmup_steps=2",
    "train.optimizer.lr=3e-3",
)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """4 steps of one process, a checkpoint at each."""
    run = tmp_path_factory.mktemp("trained")
    write_store(run, n_train=8, n_heldout=2)
    r = launch(run, *BASE, procs=1)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def adam_rate(before: Path, after: Path, t: int) -> float:
    """The rate AdamW (betas 0.9/0.95, eps 1e-8, no weight decay) applied in step t, from the fp32 masters of the
    checkpoints before and after it and the moments after it (a least-squares fit over every weight)."""
    a, b = load_file(before / "state.safetensors"), load_file(after / "state.safetensors")
    names = [k[len("fp32.") :] for k in b if k.startswith("fp32.")]
    step = torch.cat([(a[f"fp32.{n}"] - b[f"fp32.{n}"]).flatten() for n in names]).double()
    m = torch.cat([b[f"exp_avg.{n}"].flatten() for n in names]).double() / (1 - 0.9**t)
    v = torch.cat([b[f"exp_avg_sq.{n}"].flatten() for n in names]).double() / (1 - 0.95**t)
    u = m / (v.sqrt() + 1e-8)
    return float((step * u).sum() / (u * u).sum())


@pytest.mark.slow
def test_a_resume_runs_this_configs_rate_and_the_record_says_so(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    assert adam_rate(run / "ckpt" / "step-2", run / "ckpt" / "step-3", 3) == pytest.approx(3e-3, rel=1e-3)
    r = launch(run, *BASE, "train.optimizer.lr=0.3", procs=1, extra=("--resume", str(run / "ckpt" / "step-2")))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resume: this config's train.optimizer.lr 0.3 (the checkpoint ran 0.003) apply from step 3" in r.stdout
    rows = {m["step"]: m for m in metrics(run)}
    assert rows[3]["lr"] == pytest.approx(0.3) and rows[4]["lr"] == pytest.approx(0.3 * 0.55)  # cosine, 2 of 4 steps
    assert adam_rate(run / "ckpt" / "step-2", run / "ckpt" / "step-3", 3) == pytest.approx(0.3, rel=1e-3)
    record = yaml.safe_load((run / "config.yaml").read_text())["stages"]["train"]
    assert record["config"]["train"]["optimizer"]["lr"] == 0.3
    assert record["resumed"] == {
        "from": str(run / "ckpt" / "step-2"),
        "step": 2,
        "changed": {"train.optimizer.lr": [3e-3, 0.3]},
    }


@pytest.mark.slow
def test_a_refused_resume_changes_nothing_the_record_included(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = {k: v for k, v in tree(run).items() if not k.startswith("logs")}
    r = launch(run, *BASE, "drafter.num_hidden_layers=2", procs=1, extra=("--resume", "auto"))
    assert r.returncode != 0
    errors = [line for line in (r.stdout + r.stderr).splitlines() if re.search("error|traceback", line, re.I)]
    assert len(errors) == 1 and re.match(r"finetune: error: .*state\.json: trainable parameters", errors[0]), errors
    assert {k: v for k, v in tree(run).items() if not k.startswith("logs")} == before


@pytest.mark.slow
def test_a_diverging_loss_is_named_and_a_non_finite_one_names_the_last_good_checkpoint(trained, tmp_path, capsys):
    from eagle3ft.eval.report.build import main as report_main
    from eagle3ft.files import sha256_file as _sha256

    order = [m["samples"][0][0] for m in metrics(trained)]  # the sample of each step: the same seeded order here
    run = tmp_path / "run"
    write_store(run, n_train=8, n_heldout=2)
    shard = run / "features" / "train-00000.safetensors"
    t = load_file(shard)
    at = t["sample_ids"].tolist().index(order[3])
    t["aux_hidden"][t["offsets"][at] : t["offsets"][at + 1]] = float("nan")  # step 4's sample
    save_file(t, str(shard))
    manifest = json.loads((run / "features" / "manifest.json").read_text())
    manifest["shards"][0]["sha256"] = _sha256(shard)
    (run / "features" / "manifest.json").write_text(json.dumps(manifest))
    r = launch(run, *BASE, "train.optimizer.lr=10", "train.schedule.max_steps=6", procs=1)
    assert r.returncode != 0
    first = metrics(run)[0]["loss"]
    warning = re.search(
        r"warning: the loss (\S+) at step (\d+) is (\d+)x the first logged loss (\S+): the training is diverging; the "
        r"last good checkpoint is (\S+): resume from it with --resume \S+ and a lower train\.lr",
        r.stdout,
    )
    assert warning and int(warning[3]) >= 100, r.stdout[-3000:]
    step, good = int(warning[2]), run / "ckpt" / f"step-{int(warning[2]) - 1}"
    assert step < 4 and warning[5] == str(good)  # the newest checkpoint before the divergence
    assert re.search(
        rf"finetune: error: non-finite loss at step 4 .*sample ids per rank: \[\[{order[3]}\]\]; the last good "
        rf"checkpoint is {re.escape(str(good))}: resume from it",
        r.stderr,
    ), r.stderr[-3000:]
    assert [p.name for p in sorted((run / "ckpt").iterdir())] == ["step-1", "step-2", "step-3"]  # kept, named apart
    capsys.readouterr()
    report_main(["--config", str(TINY), "--run-dir", str(run)])
    out = capsys.readouterr().out
    report = json.loads((run / "eval" / "report.json").read_text())
    assert report["train"]["diverged"]["step"] == step and report["train"]["diverged"]["first_loss"] == first
    assert "diverg" in out and "diverg" in (run / "eval" / "report.md").read_text()


# --------------------------------------------------------------------------- one line, whatever the launcher


@pytest.mark.slow
def test_finetunes_own_refusals_end_a_two_process_launch_in_one_line(tmp_path):
    """check_start's refusals (this one, and --overwrite with --resume: the same path) end the launch as every input
    error does; in-process, each is one line with exit 2 (test_train_resume.py)."""
    run = tmp_path / "run"
    write_store(run, n_train=2, n_heldout=1)
    (run / "ckpt" / "step-2").mkdir(parents=True)
    (run / "ckpt" / "step-2" / "trainer_state.json").write_text(json.dumps({"format": FORMAT, "step": 2}))
    before = tree(run)
    r = launch(run, timeout=300)
    said = [line for line in (r.stdout + r.stderr).splitlines() if re.search("error|traceback", line, re.I)]
    assert len(said) == 1 and said[0].startswith(f"finetune.py: error: {run} already holds a training run"), said
    assert r.returncode == -9  # as every input error of an accelerate launch: rank 0 ends it (train/launcher.py)
    assert tree(run) == before  # no lock left, nothing written


def test_a_drafter_whose_config_disagrees_with_its_weights_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    from test_hardening import export, no_compute

    from eagle3ft.eval.bench.live import main as bench_main
    from eagle3ft.eval.bench.sglang_backend import SGLangBackend
    from eagle3ft.eval.offline.accept_len import main as accept_len_main

    write_store(tmp_path, n_train=2, n_heldout=2)
    folder = export(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    no_compute(monkeypatch)
    line = (
        rf"{folder / 'model.safetensors'}: tensor midlayer\.mlp\.\w+_proj\.weight has shape \[\d+, \d+\], "
        rf"{folder / 'config.json'} gives it \[\d+, \d+\]: the config and the weights are not of one drafter"
    )
    for main, prog in ((accept_len_main, "accept_len.py"), (bench_main, "live.py")):
        with pytest.raises(SystemExit) as e:
            main(["--config", str(TINY), "--run-dir", str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 1 and len(err) == 1 and re.fullmatch(f"{prog}: error: {line}", err[0]), err
    with pytest.raises(ValueError, match=line):
        SGLangBackend(load_config(TINY, ["bench.backend=sglang", "bench.sglang.launch=true"]), tmp_path)


def test_divergence_is_a_loss_100x_the_first_positive_one():
    from eagle3ft.train.metrics import diverged, divergence

    assert diverged(1001.0, 10.0) and not diverged(999.0, 10.0) and diverged(float("nan"), 10.0)
    assert not diverged(5.0, 0.0) and not diverged(
        5.0, None
    )  # a first loss of 0 (a warm start that fits) gives no ratio
    records = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 150.0}, {"step": 3, "loss": 400.0}, {"step": 4}]
    assert divergence(records) == {"step": 3, "loss": 400.0, "first_step": 1, "first_loss": 2.0, "ratio": 200.0}
    assert divergence(records[:2]) is None and divergence([]) is None
