"""The training loop through the real entry point: rank split, resume, warm start, export, bad input."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train_checkpoint import write_k2_like
from train_fixtures import REPO, TINY_TARGET, launch, write_store

from eagle3ft.config import load_config
from eagle3ft.data.store import FeatureStore, StoreError
from eagle3ft.data.store_writer import FeatureWriter
from eagle3ft.drafter.model import export_keys
from eagle3ft.train.loop import OutOfMemoryHint, oom_hint, run_training

TINY = REPO / "configs/tiny.yaml"
COMMON = (
    "train.schedule.warmup_steps=2",
    "train.optimizer.lr=3e-3",
    "train.checkpoint.save_every=2",
    "train.checkpoint.keep_checkpoints=2",
    "train.objective.ttt_steps=3",
)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]


def ok(r) -> None:
    assert r.returncode == 0, r.stderr[-4000:]


# --------------------------------------------------------------------------- bad input (in-process, before any process
# group)


def test_missing_and_empty_store_are_refused(tmp_path):
    cfg = load_config(TINY)
    with pytest.raises(StoreError, match="no feature store"):
        run_training(cfg, tmp_path)
    FeatureWriter(tmp_path / "features", TINY_TARGET, 4, False, "x").finish(torch.zeros(49152, dtype=torch.int64))
    with pytest.raises(StoreError, match="has no shards"):
        run_training(cfg, tmp_path)


def test_schema_mismatch_and_empty_train_split_are_refused(tmp_path):
    write_store(tmp_path, n_train=0, n_heldout=2)
    with pytest.raises(StoreError, match="train split is empty"):
        run_training(load_config(TINY), tmp_path)
    manifest = tmp_path / "features" / "manifest.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**m, "schema_version": 99}))
    with pytest.raises(StoreError, match="schema_version 99"):
        run_training(load_config(TINY), tmp_path)


def test_missing_vocab_names_the_harvest(tmp_path):
    write_store(tmp_path, n_train=2, n_heldout=0)
    (tmp_path / "vocab.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="harvest"):
        run_training(load_config(TINY), tmp_path)


def test_out_of_memory_gets_a_hint():
    with pytest.raises(OutOfMemoryHint, match="micro_batch_size.*zero3.json") as e:
        with oom_hint():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "Tried to allocate 2.00 GiB" in str(e.value)


# --------------------------------------------------------------------------- real launches (2 CPU processes, DeepSpeed
# ZeRO-2)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight")
    write_store(run)
    ok(launch(run, "train.schedule.max_steps=6", *COMMON))
    return run


@pytest.mark.slow
def test_two_ranks_split_the_data_and_a_run_leaves_checkpoints_and_export(straight):
    rows = metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    seen = []
    for r in rows:
        rank0, rank1 = r["samples"]
        assert len(rank0) == len(rank1) == 1 and rank0 != rank1, r["samples"]  # micro batch 1 per rank
        seen += rank0 + rank1
    assert len(set(seen)) == 12 and set(seen) <= set(
        range(16)
    )  # 6 steps x 2 ranks: 12 of the 16 training samples, none twice
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    for r in rows:  # where each step's time went; no "between" span after the start or a checkpoint (every 2 steps)
        assert list(r["phase_s"]) == ["between", "forward", "backward", "optimizer"]
        assert all(r["phase_s"][k] > 0 for k in ("forward", "backward", "optimizer")), r["phase_s"]
        assert (r["phase_s"]["between"] > 0) == (r["step"] % 2 == 0), r
    assert sorted(p.name for p in (straight / "ckpt").iterdir()) == ["step-4", "step-6"]  # keep 2
    state = json.loads((straight / "ckpt" / "step-6" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["config"]["train"]["schedule"]["max_steps"] == 6
    exported = load_file(straight / "export" / "model.safetensors")
    assert set(exported) == set(export_keys())
    data = json.loads((straight / "train" / "data.json").read_text())  # what it trained on: tau_curve's x
    answers = sum(int(it["loss_mask"].sum()) for it in FeatureStore(straight / "features").dataset("train"))
    assert (data["samples"], data["answer_tokens"], data["all_answer_tokens"]) == (16, answers, answers) and answers
    ckpt = load_file(straight / "ckpt" / "step-6" / "model.safetensors")
    assert all(torch.equal(exported[k], ckpt[k]) for k in exported)


@pytest.mark.slow
def test_loader_workers_give_the_same_batches_and_losses(straight, tmp_path):
    """train.num_workers (2 by default on CUDA) loads in worker processes: the same samples, the same losses."""
    write_store(tmp_path)
    ok(launch(tmp_path, "train.schedule.max_steps=3", "train.data.num_workers=2", *COMMON))
    for a, b in zip(metrics(tmp_path), metrics(straight)[:3], strict=True):
        assert (a["samples"], a["loss"], a["step_loss"]) == (b["samples"], b["loss"], b["step_loss"])


@pytest.mark.slow
def test_resume_gives_the_same_losses_as_a_straight_run(straight, tmp_path):
    write_store(tmp_path)
    ok(launch(tmp_path, "train.schedule.max_steps=6", "train.schedule.stop_after=4", *COMMON))
    assert not (tmp_path / "export").exists()  # stopped early: checkpoint only
    ok(launch(tmp_path, "train.schedule.max_steps=6", *COMMON, extra=("--resume", "auto")))
    resumed, ref = metrics(tmp_path), metrics(straight)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed, ref):  # the same processes, the same order of sums: bit-identical
        assert (a["samples"], a["loss"], a["step_loss"], a["lr"]) == (
            b["samples"],
            b["loss"],
            b["step_loss"],
            b["lr"],
        ), a["step"]
    assert "resume: auto" in (tmp_path / "config.yaml").read_text()
    a, b = load_file(tmp_path / "export" / "model.safetensors"), load_file(straight / "export" / "model.safetensors")
    for k in a:  # the final weights also depend on the restored optimizer state of steps 5 and 6
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_zero3_trains_like_zero2_and_exports_whole_weights(straight, tmp_path):
    write_store(tmp_path)
    ok(launch(tmp_path, "train.schedule.max_steps=6", *COMMON, "train.engine.deepspeed=configs/deepspeed/zero3.json"))
    for a, b in zip(metrics(tmp_path), metrics(straight)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
    z3, z2 = load_file(tmp_path / "export" / "model.safetensors"), load_file(straight / "export" / "model.safetensors")
    assert set(z3) == set(z2)
    for k in (
        z2
    ):  # whole, gathered weights with ZeRO-2's values (same data, seed and steps): a shard or a stale copy differs
        assert z3[k].shape == z2[k].shape, k
        torch.testing.assert_close(z3[k], z2[k], rtol=1e-3, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    assert not torch.equal(
        z2["fc.weight"], load_file(straight / "ckpt" / "step-4" / "model.safetensors")["fc.weight"]
    )  # the weights moved in steps 5-6


@pytest.mark.slow
def test_warm_start_keeps_the_drafters_vocab_and_exports_every_key(tmp_path):
    write_store(tmp_path)
    init = write_k2_like(tmp_path / "k2")
    r = launch(tmp_path, f"drafter.init={tmp_path / 'k2'}", "train.schedule.max_steps=2", *COMMON, procs=1)
    ok(r)
    out = load_file(tmp_path / "export" / "model.safetensors")
    assert set(out) == set(init) == set(export_keys())
    assert torch.equal(out["d2t"], init["d2t"]) and torch.equal(out["t2d"], init["t2d"])
    run_vocab = load_file(
        tmp_path / "vocab.safetensors"
    )  # the harvest's (512 tokens) was replaced by the drafter's, saying so
    assert torch.equal(run_vocab["d2t"], init["d2t"]) and torch.equal(run_vocab["t2d"], init["t2d"])
    assert (
        "had 512 draft tokens, the drafter 256; rewrote it with the warm-start drafter's d2t/t2d" in r.stdout + r.stderr
    )
    for k in init:
        assert out[k].shape == init[k].shape, k
    assert not torch.equal(out["lm_head.weight"].float(), init["lm_head.weight"].float())  # it trained
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 256 and cfg["rope_scaling"]["type"] == "yarn"


@pytest.mark.slow
def test_non_finite_loss_stops_naming_step_and_sample(tmp_path):
    write_store(tmp_path, n_train=4, n_heldout=0)
    shard = tmp_path / "features" / "train-00000.safetensors"
    t = load_file(shard)
    t["aux_hidden"][t["offsets"][2] : t["offsets"][3]] = float("nan")  # sample id 2
    from safetensors.torch import save_file

    from eagle3ft.files import sha256_file as _sha256

    save_file(t, str(shard))
    manifest = json.loads((tmp_path / "features" / "manifest.json").read_text())
    manifest["shards"][0]["sha256"] = _sha256(shard)
    (tmp_path / "features" / "manifest.json").write_text(json.dumps(manifest))
    r = launch(tmp_path, "train.schedule.max_steps=4", *COMMON, procs=1)
    assert r.returncode != 0
    assert "non-finite loss at step" in r.stderr and "[[2]]" in r.stderr, r.stderr[-3000:]


def test_ranks_leave_together_through_the_store(monkeypatch):
    """exit_rank's os._exit waits (launcher.leave_together) until every rank has ended its process group; a peer that
    never arrives costs the timeout, not a hang."""
    import time

    from eagle3ft.train import launcher

    launcher.leave_together()  # no Dist.end of several processes: nothing to wait for
    store = torch.distributed.HashStore()
    store.set("eagle3ft/ended/1", "1")  # rank 1 already left
    monkeypatch.setattr(launcher, "_peers", (store, 0, 2))
    t = time.monotonic()
    launcher.leave_together(timeout_s=5)
    assert time.monotonic() - t < 2 and store.get("eagle3ft/ended/0") == b"1"
    monkeypatch.setattr(launcher, "_peers", (store, 0, 3))  # rank 2 never comes
    t = time.monotonic()
    launcher.leave_together(timeout_s=0.5)
    assert 0.4 < time.monotonic() - t < 5
