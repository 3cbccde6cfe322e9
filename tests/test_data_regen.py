"""Regeneration (data/regen.py): multi-turn through the SGLang double, two servers, a server dying mid-run,
the embedded backend, ShareGPT's split parts, and features harvested from a token store."""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from eagle3ft.config import REPO_ROOT, SourceConfig, load_config
from eagle3ft.data.chat import ChatFormat
from eagle3ft.data.prompts import collect, merge_split_parts
from eagle3ft.data.regen import RegenError, longest_first, main, run_regen
from eagle3ft.data.tokens import TokenStore
from eagle3ft.targets.hf import load_target

sys.path.insert(0, str(Path(__file__).parent))
from sglang_double import DoubleEngine, SGLangDouble  # noqa: E402

TINY = REPO_ROOT / "configs" / "tiny.yaml"
BASE = [
    "harvest.sources=[{kind: sharegpt, limit: 7}, {kind: mtbench, limit: 2, split: heldout}]",
    "harvest.shard_samples=2",
    "harvest.max_turns=3",
    "harvest.max_new_tokens=16",
]


def sglang_cfg(urls, *extra):
    sets = BASE + [
        "harvest.backend=sglang",
        f"harvest.sglang.urls=[{', '.join(urls)}]",
        "harvest.sglang.concurrency=2",
        "harvest.sglang.prompts_per_request=3",
        "harvest.sglang.retries=1",
        "harvest.sglang.backoff_s=0.01",
        *extra,
    ]
    return load_config(TINY, sets)


@pytest.fixture(scope="module")
def stopping_model():
    """The tiny random Llama, with the end-of-turn token made the argmax wherever its most generated token was,
    so greedy answers end (a random model never says <|im_end|> by itself) and conversations go on to turn 2."""
    cfg = load_config(TINY)
    model, tok = load_target(cfg.target)
    eot = ChatFormat(tok, cfg.target.chat_template).stop_ids[0]
    ids = torch.tensor([tok("Tell me about the sea and the sky, please.")["input_ids"]])
    out = model.generate(input_ids=ids, max_new_tokens=24, do_sample=False, pad_token_id=eot)[0, ids.shape[1] :]
    common = Counter(out.tolist()).most_common(1)[0][0]
    with torch.no_grad():
        model.lm_head.weight[eot] = 1.5 * model.lm_head.weight[common]
    return model, tok


class Recorder(DoubleEngine):
    """The double's engine, recording every prompt it was asked and what it answered."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.log: list[tuple[list[int], list[int]]] = []
        self.priorities: dict[tuple[int, ...], int | None] = {}

    def generate(self, req):
        out, timeline = super().generate(req)
        with self.lock:
            self.log.append((list(req["input_ids"]), list(out["output_ids"])))
            self.priorities[tuple(req["input_ids"])] = req.get("priority")
        return out, timeline


@pytest.fixture(scope="module")
def doubles(stopping_model):
    model, tok = stopping_model
    ds = [SGLangDouble(Recorder(model, tok), version="0.5.17").start() for _ in range(2)]
    yield ds
    for d in ds:
        d.stop()


@pytest.fixture(scope="module")
def reference(doubles, tmp_path_factory):
    run = tmp_path_factory.mktemp("ref")
    summary = run_regen(sglang_cfg([doubles[0].url]), run)
    return run, summary


def items(run: Path) -> dict:
    store = TokenStore(run / "tokens")
    return {
        s: [(x["sample_id"], x["input_ids"].tolist(), x["loss_mask"].tolist()) for x in store.dataset(s)]
        for s in ("train", "heldout")
    }


def test_multi_turn_prompts_carry_the_targets_own_answer_ids(reference, doubles):
    run, summary = reference
    store = TokenStore(run / "tokens")
    assert (
        store.complete and summary["counts"]["train"]["samples"] == 7 and summary["counts"]["heldout"]["samples"] == 2
    )
    turns = sum(summary["counts"][s]["turns"] for s in ("train", "heldout"))
    assert turns > 9, "some conversations must reach a second turn"
    assert summary["answers"] == turns and summary["answer_tokens"] == sum(
        summary["counts"][s]["loss_tokens"] for s in ("train", "heldout")
    )
    log = doubles[0].engine.log
    answered = {tuple(p): o for p, o in log}
    later = [
        (p, o)
        for p, o in log
        if any(len(q) < len(p) and p[: len(q) + len(a)] == list(q) + a for q, a in answered.items())
    ]
    assert later, "a turn-2 prompt starts with turn 1's prompt and its regenerated ids"

    def expected_mask(seq: list[int]) -> list[int]:
        """1 on every answer the double gave along the chain of turns that built `seq`, 0 elsewhere."""
        prompt, answer = next((list(p), o) for p, o in answered.items() if list(p) + o == seq)
        prev = [
            list(q) + a
            for q, a in answered.items()
            if len(q) + len(a) <= len(prompt) and prompt[: len(q) + len(a)] == list(q) + a
        ]
        head = expected_mask(max(prev, key=len)) if prev else []
        return head + [0] * (len(prompt) - len(head)) + [1] * len(answer)

    for sid, ids, mask in items(run)["train"] + items(run)["heldout"]:
        assert mask == expected_mask(ids)
    assert json.loads((run / "tokens" / "summary.json").read_text())["answer_tokens"] == summary["answer_tokens"]


def test_two_servers_share_the_work_and_give_the_same_store(reference, doubles, tmp_path):
    before = [d.requests for d in doubles]
    summary = run_regen(sglang_cfg([d.url for d in doubles]), tmp_path)
    assert all(d.requests > b for d, b in zip(doubles, before))
    assert items(tmp_path) == items(reference[0]) and summary["counts"] == reference[1]["counts"]


def test_a_conversation_stays_on_one_server_and_its_turns_carry_the_turns_left(reference, stopping_model, tmp_path):
    model, tok = stopping_model
    ds = [SGLangDouble(Recorder(model, tok), version="0.5.17").start() for _ in range(2)]
    try:
        run_regen(sglang_cfg([d.url for d in ds], "harvest.sglang.prompts_per_request=1"), tmp_path)
    finally:
        for d in ds:
            d.stop()
    assert all(d.engine.priorities for d in ds), "both servers get conversations"
    chains = []
    for split, rows in items(tmp_path).items():
        for _, ids, _ in rows:
            chain = sorted(
                (len(p), k, prio)
                for k, d in enumerate(ds)
                for p, prio in d.engine.priorities.items()
                if ids[: len(p)] == list(p)
            )
            assert len({k for _, k, _ in chain}) == 1, "every turn of a conversation goes to the same server"
            prios = [prio for *_, prio in chain]
            assert prios == list(range(prios[0], prios[0] - len(prios), -1)), "one user turn fewer left per turn"
            chains.append(prios)
    assert all(1 <= c[-1] and c[0] <= 3 for c in chains)  # harvest.max_turns=3: at most 3 user turns left
    assert max(map(len, chains)) > 1 and items(tmp_path) == items(reference[0])


def test_first_come_first_served_sends_no_priority_and_makes_the_same_store(reference, stopping_model, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("regen_speed", REPO_ROOT / "benchmarks" / "regen_speed.py")
    regen_speed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(regen_speed)
    assert regen_speed.parse_settings("128x8, 1024x1:fifo") == [(128, 8, True), (1024, 1, False)]
    with pytest.raises(SystemExit, match="CxB"):
        regen_speed.parse_settings("8x1:lifo")
    model, tok = stopping_model
    with SGLangDouble(Recorder(model, tok), version="0.5.17") as d:
        summary = run_regen(sglang_cfg([d.url], "harvest.sglang.priority=false"), tmp_path)
        assert set(d.engine.priorities.values()) == {None}
    assert summary["generation"]["priority"] is False and items(tmp_path) == items(reference[0])


def test_ready_turns_come_out_highest_priority_first_and_in_order_among_equals():
    from eagle3ft.data.regen_backends import Gen
    from eagle3ft.data.regen_turns import ReadyTurns

    q = ReadyTurns()
    for name, prio in [("a", 1), ("b", 3), ("c", 2), ("d", 3), ("e", 1)]:
        q.put(name, Gen([1], 4, 0, priority=prio))
    out = [q.get(timeout=0.1)[0]] + [q.get_nowait()[0] for _ in range(4)]
    assert out == ["b", "d", "c", "a", "e"]


def test_a_server_dying_mid_run_stops_with_its_name_and_a_rerun_completes_equal(reference, stopping_model, tmp_path):
    model, tok = stopping_model
    one_at_a_time = ("harvest.sglang.concurrency=1",)  # the same calls in the same order on every run
    with SGLangDouble(DoubleEngine(model, tok), version="0.5.17") as counting:
        run_regen(sglang_cfg([counting.url], *one_at_a_time), tmp_path / "count")
        calls = counting.requests
    dying = SGLangDouble(DoubleEngine(model, tok), version="0.5.17").start()
    dying.die_after = calls - 1  # the server dies at the last call, after the chunks finished before it were committed
    with pytest.raises(RegenError, match=f"127.0.0.1:{dying.port}"):
        run_regen(sglang_cfg([dying.url], *one_at_a_time), tmp_path)
    dying.kill()
    partial = TokenStore(tmp_path / "tokens")
    assert not partial.complete and sum(len(v) for v in partial.manifest["chunks_done"].values()) > 0
    with SGLangDouble(DoubleEngine(model, tok), version="0.5.17") as fresh:
        summary = run_regen(sglang_cfg([fresh.url]), tmp_path)
    assert summary["chunks_resumed"] == sum(len(v) for v in partial.manifest["chunks_done"].values())
    assert items(tmp_path) == items(reference[0])


def test_cli_error_is_one_line_when_no_server_answers(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(
            [
                "--config",
                str(TINY),
                "--run-dir",
                str(tmp_path),
                "--set",
                "harvest.backend=sglang",
                "--set",
                "harvest.sglang.urls=[http://127.0.0.1:9]",
                "--set",
                "harvest.sglang.retries=0",
            ]
        )
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("regen: error: ") and "127.0.0.1:9" in err and "\n" not in err


def test_embedded_backend_through_the_entry_point(stopping_model, tmp_path, monkeypatch, capsys):
    import eagle3ft.targets.hf as hf

    monkeypatch.setattr(hf, "load_target", lambda cfg: stopping_model)
    main(
        [
            "--config",
            str(TINY),
            "--run-dir",
            str(tmp_path),
            *sum((["--set", s] for s in BASE), []),
            "--set",
            "harvest.batch_size=4",
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["generation"]["backend"] == "hf" and summary["counts"]["train"]["samples"] == 7
    for split, rows in items(tmp_path).items():
        for _, ids, mask in rows:
            assert len(ids) == len(mask) and 0 < sum(mask) < len(ids)
    again = run_regen(load_config(TINY, BASE), tmp_path)  # everything committed: a rerun only resumes
    assert again["chunks_resumed"] == again["chunks"] and again["answer_tokens"] == 0


def test_sharegpt_split_parts_are_joined_in_order():
    recs = [
        {"id": "a_0", "conversations": [1]},
        {"id": "a_5", "conversations": [2, 3]},
        {"id": "b", "conversations": [4]},
        {"id": "c_0", "conversations": [5]},
        {"id": "a_0", "conversations": [6]},
    ]
    assert list(merge_split_parts(recs)) == [
        {"id": "a", "conversations": [1, 2, 3]},
        {"id": "b", "conversations": [4]},
        {"id": "c", "conversations": [5]},
        {"id": "a", "conversations": [6]},
    ]
    convs = collect(
        [SourceConfig(kind="sharegpt")],
        max_turns=10_000,
        regenerate=True,
        heldout_fraction=0.0,
        dedupe=True,
        skips=Counter(),
    )
    assert 9000 < len(convs) < 9461  # 17,671 items are 9,460 conversations, a few duplicate or unusable
    users = [sum(m["role"] == "user" for m in c.messages) for c in convs]
    assert sum(users) > 55_000 and max(users) > 100


def test_harvest_captures_exactly_a_token_stores_ids(reference, tmp_path):
    from eagle3ft.data.harvest import run_harvest
    from eagle3ft.data.store import FeatureStore

    tokens = reference[0] / "tokens"
    cfg = load_config(TINY, [f"harvest.sources=[{{kind: tokens, path: '{tokens}'}}]", "harvest.shard_samples=4"])
    run_harvest(cfg, tmp_path)
    features = FeatureStore(tmp_path / "features")
    for split, rows in items(reference[0]).items():
        got = {x["sample_id"]: (x["input_ids"].tolist(), x["loss_mask"].tolist()) for x in features.dataset(split)}
        assert got == {sid: (ids, mask) for sid, ids, mask in rows}


def test_chitchat_conversations_alternate_speakers():
    skips: Counter = Counter()
    convs = collect(
        [SourceConfig(kind="chitchat", limit=300)],
        max_turns=10_000,
        regenerate=False,
        heldout_fraction=0.0,
        dedupe=True,
        skips=skips,
    )
    assert len(convs) == 300 and all(c.source == "chitchat" for c in convs)
    for c in convs:
        roles = [m["role"] for m in c.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and all(m["content"].strip() for m in c.messages)
    assert convs[0].messages[0]["content"] == "Hello\nHow are you doing today?"


def test_harvest_refuses_a_token_store_of_another_tokenizer(reference, tmp_path):
    from eagle3ft.data.harvest import run_harvest
    from eagle3ft.data.store import StoreError

    tokens = tmp_path / "tokens"
    tokens.mkdir()
    manifest = json.loads((reference[0] / "tokens" / "manifest.json").read_text())
    manifest["identity"]["tokenizer_sha256"] = "0" * 64
    (tokens / "manifest.json").write_text(json.dumps(manifest))
    for shard in manifest["shards"]:
        (tokens / shard["file"]).write_bytes((reference[0] / "tokens" / shard["file"]).read_bytes())
    cfg = load_config(TINY, [f"harvest.sources=[{{kind: tokens, path: '{tokens}'}}]"])
    with pytest.raises(StoreError, match="another tokenizer"):
        run_harvest(cfg, tmp_path / "run")


def test_sglang_answers_are_read_robustly():
    from eagle3ft.data.regen_backends import Gen, SGLangBackend

    b = SGLangBackend.__new__(SGLangBackend)
    b.stop_ids, b.trimmed, b._lock = [2], 0, threading.Lock()
    g = Gen([5, 6], 8, 0)

    def ans(ids, n, reason):
        return b._answer({"output_ids": ids, "meta_info": {"completion_tokens": n, "finish_reason": reason}}, g, "u")

    a = ans([9, 9, 7, 8, 2], 3, {"type": "stop", "matched": 2})  # detokenizer context before the answer (sglang#17240)
    assert (a.ids, a.finished, b.trimmed) == ([7, 8, 2], True, 1)
    a = ans([7, 8], 3, {"type": "stop", "matched": 2})  # a server that leaves the stop token out
    assert (a.ids, a.finished) == ([7, 8, 2], True)
    a = ans([7] * 8, 8, {"type": "length", "length": 8})
    assert (len(a.ids), a.finished) == (8, False)
    with pytest.raises(RegenError, match="aborted"):
        ans([7], 1, {"type": "abort", "message": "out of memory"})


def test_longest_first_puts_multi_turn_conversations_first_and_keeps_ties_in_order():
    from eagle3ft.data.prompts import Conversation

    def conv(key, users):
        msgs = [
            m
            for i in range(users)
            for m in ({"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "."})
        ]
        return Conversation(msgs, "x", key, "train")

    order = [c.key for c in longest_first([conv("a", 1), conv("b", 3), conv("c", 1), conv("d", 2), conv("e", 3)])]
    assert order == ["b", "e", "d", "a", "c"]
