"""The token store: round trip, refusal to mix runs, and resume after a real SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3ft.data.store import StoreError
from eagle3ft.data.tokens import TokenSample, TokenStore, TokenWriter

IDENTITY = {"target": "t", "tokenizer": "tok", "chat_template": "auto"}


def sample(i: int) -> TokenSample:
    n = 3 + i % 5
    return TokenSample(
        sample_id=1000 + i,
        input_ids=[(7 * i + t) % 50 for t in range(n)],
        loss_mask=[int(t >= 2) for t in range(n)],
        turns=1 + i % 2,
        unfinished=int(i % 3 == 0),
    )


def chunks(n_chunks: int, per: int = 3):
    return [("train" if c % 4 else "heldout", c, [sample(c * per + j) for j in range(per)]) for c in range(n_chunks)]


def write_all(d: Path, n_chunks: int) -> None:
    w = TokenWriter(d, IDENTITY, "fp")
    for split, c, ss in chunks(n_chunks):
        if c not in w.done(split):
            w.commit(split, c, ss, {"too_long": 1})
    w.finish()


def test_round_trip_counts_and_items(tmp_path):
    write_all(tmp_path, 6)
    store = TokenStore(tmp_path)
    assert store.complete and store.identity == IDENTITY
    want = {s: [x for split, _, ss in chunks(6) if split == s for x in ss] for s in ("train", "heldout")}
    for split, samples in want.items():
        ds = store.dataset(split)
        assert len(ds) == len(samples)
        for item, s in zip(ds, samples):
            assert item["sample_id"] == s.sample_id
            assert item["input_ids"].dtype == torch.long and item["input_ids"].tolist() == s.input_ids
            assert item["loss_mask"].tolist() == s.loss_mask
        c = store.counts(split)
        assert c["samples"] == len(samples) and c["tokens"] == sum(len(s.input_ids) for s in samples)
        assert c["loss_tokens"] == sum(sum(s.loss_mask) for s in samples)
        assert c["turns"] == sum(s.turns for s in samples) and c["unfinished_answers"] == sum(
            s.unfinished for s in samples
        )
    assert store.manifest["chunk_skips"] == {"too_long": 6}


def test_refuses_another_run_and_a_double_commit(tmp_path):
    w = TokenWriter(tmp_path, IDENTITY, "fp")
    w.commit("train", 0, [sample(0)])
    with pytest.raises(StoreError, match="already committed"):
        w.commit("train", 0, [sample(0)])
    with pytest.raises(StoreError, match="fingerprint"):
        TokenWriter(tmp_path, IDENTITY, "other")
    with pytest.raises(StoreError, match="identity"):
        TokenWriter(tmp_path, {**IDENTITY, "chat_template": "chatml"}, "fp")


def test_corrupt_shard_is_refused(tmp_path):
    write_all(tmp_path, 2)
    shard = next(tmp_path.glob("train-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="sha256"):
        TokenStore(tmp_path)


KILLED_WRITER = """
import sys, time
sys.path.insert(0, {tests!r})
from test_data_tokens import TokenWriter, IDENTITY, chunks
w = TokenWriter({d!r}, IDENTITY, "fp")
for split, c, ss in chunks(40):
    w.commit(split, c, ss)
    time.sleep(0.01)
time.sleep(60)
"""


def test_sigkill_mid_write_loses_no_chunk_and_resume_equals_a_clean_run(tmp_path):
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    code = KILLED_WRITER.format(tests=str(Path(__file__).parent), d=str(killed))
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            m = killed / "manifest.json"
            if m.exists():
                try:
                    if len(json.loads(m.read_text())["shards"]) >= 5:
                        break
                except json.JSONDecodeError:
                    pytest.fail("the manifest was seen half-written")
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    partial = TokenStore(killed)  # every listed shard is whole
    assert 5 <= len(partial.manifest["shards"]) and not partial.complete
    write_all(killed, 40)
    write_all(clean, 40)
    a, b = TokenStore(killed), TokenStore(clean)
    assert a.manifest["counts"] == b.manifest["counts"]
    for split in ("train", "heldout"):
        assert [x["sample_id"] for x in a.dataset(split)] == [x["sample_id"] for x in b.dataset(split)]
        assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a.dataset(split), b.dataset(split)))


def test_a_truncated_token_manifest_is_named(tmp_path):
    from eagle3ft.files import DamagedFile

    (tmp_path / "manifest.json").write_text('{"kind": "tok')
    with pytest.raises(DamagedFile, match=r"manifest.json: the token store's manifest is not valid JSON"):
        TokenStore(tmp_path)


def test_a_shard_entry_outside_the_folder_is_refused(tmp_path):
    """The token store checks its shard entries as the feature store does: a plain file name inside the folder."""
    d = tmp_path / "tokens"
    write_all(d, 1)
    manifest = json.loads((d / "manifest.json").read_text())
    (tmp_path / "outside.safetensors").write_bytes((d / manifest["shards"][0]["file"]).read_bytes())
    manifest["shards"][0]["file"] = "../outside.safetensors"
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match="not a \\*.safetensors file name inside"):
        TokenStore(d)
