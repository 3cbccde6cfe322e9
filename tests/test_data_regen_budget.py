"""A regeneration stopped early keeps what it generated (data/regen.py, data/regen_turns.py): ``harvest.max_seconds``
and a first SIGINT stop sending turns and commit the open chunks with each conversation cut at its last answer; a
rerun does the chunks left, duplicating nothing; a second signal aborts at once. Through the SGLang double and the
embedded target, at T=0 against unbudgeted runs of the same config."""

# ruff: noqa: F811  (stopping_model: test_data_regen's fixture, imported, then named as a test's argument)
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors import safe_open

import eagle3ft.data.regen_turns as regen_turns
from eagle3ft.config import load_config
from eagle3ft.data.regen import run_regen
from eagle3ft.data.regen_backends import HFBackend
from eagle3ft.data.tokens import TokenStore

sys.path.insert(0, str(Path(__file__).parent))
from sglang_double import DoubleEngine, SGLangDouble  # noqa: E402
from test_data_regen import BASE, TINY, sglang_cfg, stopping_model  # noqa: E402, F401  (stopping_model: a fixture)

ONE_AT_A_TIME = ("harvest.sglang.concurrency=1", "harvest.sglang.prompts_per_request=1")


class Gate:
    """Runs `action(first_call_time)` before call number `at` (1-based) of a generation, and logs every answer."""

    def __init__(self, at: int, action):
        self.at, self.action = at, action
        self.calls, self.t_first, self.log = 0, None, []
        self.lock = threading.Lock()
        self.released = threading.Event()

    def before(self) -> None:
        with self.lock:
            self.calls += 1
            self.t_first = self.t_first or time.time()
            mine = self.calls == self.at
        if mine:
            self.action(self.t_first)
            self.released.set()


class GatedEngine(DoubleEngine):
    def __init__(self, gate: Gate, *a, **k):
        super().__init__(*a, **k)
        self.gate = gate

    def generate(self, req):
        self.gate.before()
        out, timeline = super().generate(req)
        with self.gate.lock:
            self.gate.log.append((list(req["input_ids"]), list(out["output_ids"])))
        return out, timeline


def sleep_until(offset: float):
    return lambda t_first: time.sleep(max(0.0, t_first + offset - time.time()))


def signals(*delays: float):
    def act(_):
        for d in delays:
            time.sleep(d)
            os.kill(os.getpid(), signal.SIGINT)

    return act


def chunks(run: Path) -> dict[tuple[str, int], dict[int, tuple[list[int], list[int]]]]:
    """{(split, chunk): {sample_id: (input_ids, loss_mask)}} of a token store, read shard by shard."""
    m = TokenStore(run / "tokens").manifest
    out = {}
    for s in m["shards"]:
        with safe_open(run / "tokens" / s["file"], framework="pt") as f:
            ids, mask, off = (f.get_tensor(k).tolist() for k in ("input_ids", "loss_mask", "offsets"))
            sids = f.get_tensor("sample_ids").tolist()
        out[(s["split"], s["chunk"])] = {sid: (ids[a:b], mask[a:b]) for sid, a, b in zip(sids, off, off[1:])}
    return out


def done_chunks(run: Path, key: str = "chunks_done") -> set[tuple[str, int]]:
    path = run / "tokens" / "manifest.json"
    m = json.loads(path.read_text()) if path.is_file() else {}  # no manifest before the first commit
    return {(s, c) for s, cs in m.get(key, {}).items() for c in cs}


def check_cut_prefixes(run: Path, ref: Path, summary: dict, log: list | None = None) -> None:
    """Every stored conversation is its unbudgeted twin up to the end of one of its answers (whole where its chunk
    was not cut), the store holds exactly the answers that came back, and a conversation is stored at most once."""
    got, want = chunks(run), chunks(ref)
    cut = done_chunks(run, "chunks_cut")
    assert done_chunks(run) >= set(got) and cut <= done_chunks(run)
    for key, rows in got.items():
        if key not in cut:
            assert rows == want[key], f"{key} was committed whole: it equals the unbudgeted run's"
            continue
        for sid, (ids, mask) in rows.items():
            ref_ids, ref_mask = want[key][sid]
            n = len(ids)
            assert ids == ref_ids[:n] and mask == ref_mask[:n] and mask[-1] == 1, "a prefix ending in an answer"
            assert n == len(ref_ids) or ref_mask[n] == 0, "cut at the end of an answer, not inside one"
    ids = [sid for rows in got.values() for sid in rows]
    assert len(ids) == len(set(ids)), "no conversation twice"
    stored = [(ids, mask) for rows in got.values() for ids, mask in rows.values()]
    spans = sum(sum(1 for t in range(len(m)) if m[t] and (t == 0 or not m[t - 1])) for _, m in stored)
    assert spans == summary["answers"] and sum(sum(m) for _, m in stored) == summary["answer_tokens"]
    for prompt, answer in log or []:  # every answer the server gave is in the store
        assert any(ids[: len(prompt) + len(answer)] == prompt + answer for ids, _ in stored)


@pytest.fixture(scope="module")
def reference(stopping_model, tmp_path_factory):
    model, tok = stopping_model
    run = tmp_path_factory.mktemp("ref")
    with SGLangDouble(DoubleEngine(model, tok), version="0.5.17") as d:
        run_regen(sglang_cfg([d.url], *ONE_AT_A_TIME), run)
    return run


def stopped_run(stopping_model, run: Path, gate: Gate, *sets: str) -> dict:
    model, tok = stopping_model
    with SGLangDouble(GatedEngine(gate, model, tok), version="0.5.17") as d:
        return run_regen(sglang_cfg([d.url], *ONE_AT_A_TIME, *sets), run)


def test_a_budget_keeps_exactly_the_finished_turns(stopping_model, reference, tmp_path):
    gate = Gate(4, sleep_until(2.5))  # the 4th turn is in flight when the budget ends, and comes back in the wait
    summary = stopped_run(stopping_model, tmp_path, gate, "harvest.max_seconds=1.5")
    st = summary["stopped"]
    assert st["reason"] == "max_seconds" and st["turns_dropped_in_flight"] == 0 and st["chunks_left"] > 0
    assert st["conversations_cut"] >= 1 and st["chunks_cut"] >= 1 and summary["answers"] == len(gate.log) >= 4
    assert not TokenStore(tmp_path / "tokens").complete
    check_cut_prefixes(tmp_path, reference, summary, gate.log)
    saved = json.loads((tmp_path / "tokens" / "summary.json").read_text())
    assert saved["stopped"] == st and saved["skips"]["turns_cut_by_stop"] >= 1


def test_sigint_stops_the_same_way_and_a_rerun_completes_the_rest_once(stopping_model, reference, tmp_path):
    gate, handler = Gate(4, signals(0.0)), signal.getsignal(signal.SIGINT)
    summary = stopped_run(stopping_model, tmp_path, gate)
    st = summary["stopped"]
    assert st["reason"] == "SIGINT" and st["chunks_left"] > 0 and st["conversations_cut"] >= 1
    check_cut_prefixes(tmp_path, reference, summary, gate.log)
    assert signal.getsignal(signal.SIGINT) is handler, "the handler is given back"
    stopped, cut = chunks(tmp_path), done_chunks(tmp_path, "chunks_cut")

    with SGLangDouble(DoubleEngine(*stopping_model), version="0.5.17") as d:
        again = run_regen(sglang_cfg([d.url], *ONE_AT_A_TIME), tmp_path)
    assert again["stopped"] is None and again["chunks_resumed"] == len(done_chunks(reference)) - st["chunks_left"]
    assert TokenStore(tmp_path / "tokens").complete and done_chunks(tmp_path) == done_chunks(reference)
    final, want = chunks(tmp_path), chunks(reference)
    for key in want:
        assert final.get(key) == (stopped.get(key) if key in cut else want[key]), "cut chunks stay cut, others whole"
    ids = [sid for rows in final.values() for sid in rows]
    assert len(ids) == len(set(ids))


def test_a_second_signal_aborts_at_once_keeping_only_whole_chunks(stopping_model, reference, tmp_path):
    gate = Gate(3, signals(0.0, 0.5))  # the second one comes while the first stop waits for this very turn
    with pytest.raises(KeyboardInterrupt):
        stopped_run(stopping_model, tmp_path, gate)
    assert not done_chunks(tmp_path, "chunks_cut")  # the open chunks are lost, as a kill loses them
    if done_chunks(tmp_path):
        got, want = chunks(tmp_path), chunks(reference)
        assert all(rows == want[key] for key, rows in got.items())


def test_embedded_backend_a_turn_in_flight_past_the_wait_is_dropped(stopping_model, tmp_path, monkeypatch):
    import eagle3ft.targets.hf as hf

    monkeypatch.setattr(hf, "load_target", lambda cfg: stopping_model)
    sets = [*BASE, "harvest.batch_size=1"]
    run_regen(load_config(TINY, sets), tmp_path / "ref")

    gate = Gate(3, sleep_until(4.0))  # stop at 2 s, give up on the 3rd turn at 2.3 s: it comes back at 4 s
    plain = HFBackend.generate

    def gated(self, slot, batch):
        gate.before()
        return plain(self, slot, batch)

    monkeypatch.setattr(HFBackend, "generate", gated)
    monkeypatch.setattr(regen_turns, "DRAIN_S", 0.3)
    run = tmp_path / "run"
    summary = run_regen(load_config(TINY, [*sets, "harvest.max_seconds=2"]), run)
    gate.released.wait(10)  # the dropped turn's thread ends before the model is used again
    st = summary["stopped"]
    assert st["reason"] == "max_seconds" and st["turns_dropped_in_flight"] == 1 and summary["answers"] == 2
    assert summary["generation"]["backend"] == "hf"
    check_cut_prefixes(run, tmp_path / "ref", summary)
    again = run_regen(load_config(TINY, sets), run)
    assert again["chunks_resumed"] == len(done_chunks(run)) - st["chunks_left"] and TokenStore(run / "tokens").complete
    ids = [sid for rows in chunks(run).values() for sid in rows]
    assert len(ids) == len(set(ids))
