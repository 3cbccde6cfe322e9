"""The harvest job end to end on the tiny random Llama: bad input, regeneration, vocab, errors, SIGKILL + resume."""

import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file
from test_data_prompts import bad_corpus_lines

from eagle3ft.config import REPO_ROOT, ConfigError, load_config
from eagle3ft.data.chat import ChatFormat
from eagle3ft.data.harvest import HarvestJob, harvest_chunk, main, run_harvest
from eagle3ft.data.prompts import Conversation
from eagle3ft.data.store import FeatureStore
from eagle3ft.drafter.vocab import build_vocab, check_vocab, load_vocab
from eagle3ft.targets.base import Request, Sampling
from eagle3ft.targets.hf import HFTarget, load_target

TINY = REPO_ROOT / "configs" / "tiny.yaml"
HARVEST = REPO_ROOT / "data" / "harvest.py"


def tiny_cfg(*overrides):
    return load_config(TINY, list(overrides))


@pytest.fixture(scope="module")
def bad_corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "bad.jsonl"
    path.write_bytes(b"\n".join(bad_corpus_lines()) + b"\n")
    return path


@pytest.fixture(scope="module")
def tiny_model():
    return load_target(tiny_cfg().target)


@pytest.fixture(scope="module")
def harvested(tmp_path_factory, bad_corpus):
    run = tmp_path_factory.mktemp("run")
    cfg = tiny_cfg(
        f"harvest.sources=[{{kind: file, path: '{bad_corpus}'}}, {{kind: sharegpt, limit: 4}}, {{kind: mtbench, limit: "
        "2, split: heldout}]",
        "harvest.max_new_tokens=8",
    )
    return cfg, run, run_harvest(cfg, run)


def test_bad_input_is_counted_and_the_rest_harvested(harvested):
    cfg, run, summary = harvested
    skips = summary["skips"]
    for reason, n in {"malformed": 2, "empty": 2, "unknown_role": 1, "invalid_utf8": 1, "duplicate": 1}.items():
        assert skips[reason] == n, reason
    assert summary["samples"] == {"train": 6, "heldout": 2}
    assert json.loads((run / "features" / "summary.json").read_text()) == summary
    store = FeatureStore(run / "features")
    assert store.manifest["complete"] and store.manifest["skips"] == skips
    assert sum(s["tokens"] for s in store.manifest["shards"]) == summary["tokens"]
    assert summary["bytes_per_token"] > 3 * 64 * 2  # at least the bf16 aux rows


def test_answers_are_the_targets_own_and_features_match_a_fresh_capture(harvested, tiny_model):
    cfg, run, _ = harvested
    model, tok = tiny_model
    target = HFTarget(cfg.target, [0, 1, 2], model=model, tokenizer=tok)
    chat = ChatFormat(tok)
    for item in FeatureStore(run / "features").dataset("train"):
        ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
        start = max(i for i in range(len(mask)) if mask[i] == 0) + 1  # the last assistant turn
        prompt, answer = ids[:start], ids[start:]
        assert 0 < len(answer) <= cfg.harvest.max_new_tokens
        (again,) = target.process(
            [Request(prompt, cfg.harvest.max_new_tokens, tuple(chat.stop_ids), capture=True)],
            Sampling(topk=cfg.harvest.topk),
        )
        assert again.completion_ids == answer
        torch.testing.assert_close(again.features.aux_hidden.float(), item["aux_hidden"].float(), atol=0.02, rtol=0.02)
        assert (again.features.topk_ids.long() == item["topk_ids"]).float().mean() > 0.99


def test_vocab_is_built_from_masked_counts(harvested):
    cfg, run, summary = harvested
    d2t, t2d = load_vocab(run / "vocab.safetensors")
    counts = FeatureStore(run / "features").token_counts()
    loss_tokens = sum(int(it["loss_mask"].sum()) for it in FeatureStore(run / "features").dataset("train"))
    assert int(counts.sum()) == loss_tokens
    check_vocab(d2t, t2d, 49152, 512)
    expect = build_vocab(counts, 512)
    assert torch.equal(d2t, expect[0]) and torch.equal(t2d, expect[1])
    assert bool(t2d[counts > 0].all()) or int((counts > 0).sum()) > 512


def test_warm_start_keeps_the_drafters_vocab(tmp_path):
    ckpt = tmp_path / "drafter"
    ckpt.mkdir()
    target_ids = torch.arange(0, 49152, 96)  # 512 tokens no count would pick
    t2d = torch.zeros(49152, dtype=torch.bool)
    t2d[target_ids] = True
    save_file({"d2t": target_ids - torch.arange(512), "t2d": t2d}, str(ckpt / "model.safetensors"))
    cfg = tiny_cfg(
        f"drafter.init={ckpt}",
        "harvest.sources=[{kind: sharegpt, limit: 2}]",
        "harvest.max_new_tokens=4",
        "harvest.max_turns=1",
        "harvest.store_last_hidden=true",
    )
    summary = run_harvest(cfg, tmp_path / "run")
    assert summary["draft_vocab"]["source"] == "drafter.init"
    item = FeatureStore(tmp_path / "run" / "features").dataset("train")[0]
    assert item["last_hidden"].shape == (len(item["input_ids"]), 64) and item["last_hidden"].dtype == torch.bfloat16
    d2t, got = load_vocab(tmp_path / "run" / "vocab.safetensors")
    assert torch.equal(got, t2d) and torch.equal(d2t, target_ids - torch.arange(512))


def test_nonfinite_hidden_states_are_skipped(tiny_model):
    cfg = tiny_cfg()
    model, tok = tiny_model
    model = copy.deepcopy(model)
    chat = ChatFormat(tok)
    poison = tok("zebra", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = float("nan")
    target = HFTarget(cfg.target, [0, 1, 2], model=model, tokenizer=tok)
    convs = [
        Conversation([{"role": "user", "content": text}], "test", key, "train")
        for text, key in (("Say hi.", "a" * 64), ("zebra", "b" * 64))
    ]
    job = HarvestJob(target, chat, cfg.harvest, Sampling(topk=4), 0)
    samples, stats = harvest_chunk(job, convs, lambda n, t: None)
    assert [s.sample_id for s in samples] == [int("a" * 15, 16)] and stats.skips == Counter({"nonfinite_features": 1})


def test_config_errors_come_before_compute(tmp_path, capsys):
    with pytest.raises(ConfigError, match="harvest.topkk"):
        tiny_cfg("harvest.topkk=3")
    with pytest.raises(SystemExit):
        main(["--config", str(TINY), "--run-dir", str(tmp_path / "r"), "--set", "harvest.shard_sample=3"])
    assert "unknown config key 'harvest.shard_sample'" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        run_harvest(tiny_cfg(f"harvest.sources=[{{kind: file, path: '{tmp_path}/missing.jsonl'}}]"), tmp_path / "r")
    with pytest.raises(ValueError, match="target_hidden_size 576 != target hidden_size 64"):
        run_harvest(tiny_cfg("drafter.config=configs/drafters/smollm2-135m.json"), tmp_path / "r")
    bad_ids = tmp_path / "drafter.json"
    spec = json.loads((REPO_ROOT / "configs" / "drafters" / "tiny.json").read_text())
    spec["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 4]
    bad_ids.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=r"\[4\] outside the target's layers 0..3"):
        run_harvest(tiny_cfg(f"drafter.config={bad_ids}"), tmp_path / "r")
    assert not (tmp_path / "r" / "features").exists()


def harvest_cmd(run_dir):
    sets = [
        "harvest.sources=[{kind: sharegpt, limit: 16}]",
        "harvest.shard_samples=2",
        "harvest.batch_size=2",
        "harvest.max_new_tokens=48",
    ]
    return [sys.executable, str(HARVEST), "--config", str(TINY), "--run-dir", str(run_dir)] + [
        a for s in sets for a in ("--set", s)
    ]


def store_records(features):
    store = FeatureStore(features)
    recs = {}
    for split in ("train", "heldout"):
        for item in store.dataset(split):
            assert item["sample_id"] not in recs, "duplicated sample"
            recs[item["sample_id"]] = item
    return store.manifest, recs


@pytest.mark.slow
def test_sigkill_mid_harvest_then_rerun_equals_an_uninterrupted_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "tests")}
    subprocess.run(harvest_cmd(tmp_path / "whole"), check=True, env=env, capture_output=True)

    proc = subprocess.Popen(
        harvest_cmd(tmp_path / "killed"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    manifest = tmp_path / "killed" / "features" / "manifest.json"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if manifest.exists() and json.loads(manifest.read_text())["chunks_done"]["train"]:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    assert proc.wait() == -signal.SIGKILL, "the harvest finished before it could be killed"
    partial = json.loads(manifest.read_text())
    assert not partial["complete"] and 1 <= len(partial["chunks_done"]["train"]) < 8

    rerun = subprocess.run(harvest_cmd(tmp_path / "killed"), check=True, env=env, capture_output=True, text=True)
    summary = json.loads(rerun.stdout)
    assert summary["chunks_resumed"] == len(partial["chunks_done"]["train"]) + len(partial["chunks_done"]["heldout"])

    m_whole, whole = store_records(tmp_path / "whole" / "features")
    m_killed, killed = store_records(tmp_path / "killed" / "features")
    assert sorted(whole) == sorted(killed) and len(whole) == 16
    for sid, a in whole.items():
        b = killed[sid]
        for k in a:
            assert (a[k] == b[k]) if k == "sample_id" else torch.equal(a[k], b[k]), (sid, k)
    assert [s["sha256"] for s in m_whole["shards"]] == [s["sha256"] for s in m_killed["shards"]]
    assert m_whole["counts"] == m_killed["counts"]
    assert not list((tmp_path / "killed" / "features").glob(".*.tmp"))
