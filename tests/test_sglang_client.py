"""The SGLang harvest client against the protocol double (real tiny model, real HTTP on loopback)."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import requests
import torch

from eagle3ft.config import REPO_ROOT, SGLangClientConfig, load_config
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.targets import sglang_http
from eagle3ft.targets.base import Request, Sampling
from eagle3ft.targets.hf import HFTarget, load_target
from eagle3ft.targets.sglang import SGLangTarget
from eagle3ft.targets.sglang_http import HiddenStream, RetryableError, SGLangError, server_info, topk_arrays

sys.path.insert(0, str(Path(__file__).parent))
from sglang_double import DoubleEngine, SGLangDouble  # noqa: E402

SAMPLING = Sampling(temperature=0.0, topk=8)
PROMPTS = ["Hello there, how are", "The capital of France", "1 2 3 4 5 6", "Write a haiku about rain"]


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(REPO_ROOT / "configs/tiny.yaml")
    model, tok = load_target(cfg.target)
    c = model.config
    ids = DrafterConfig.from_json(REPO_ROOT / cfg.drafter.config).check_target(
        c.hidden_size, c.vocab_size, c.num_hidden_layers
    )
    return cfg, model, tok, ids


@pytest.fixture(scope="module")
def embedded(tiny):
    cfg, model, tok, ids = tiny
    return HFTarget(cfg.target, ids, model, tok)


@pytest.fixture(scope="module")
def drafter(tiny):
    """A seeded random drafter of configs/drafters/tiny.json over the tiny target's embedding."""
    cfg, model, _, _ = tiny
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        d = Eagle3Drafter(DrafterConfig.from_json(REPO_ROOT / cfg.drafter.config))
    with torch.no_grad():
        d.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    return d.eval()


def make_target(tiny, urls: list[str], **client) -> SGLangTarget:
    cfg, _, _, _ = tiny
    return SGLangTarget(
        cfg.target, SGLangClientConfig(urls=urls, **client), DrafterConfig.from_json(REPO_ROOT / cfg.drafter.config)
    )


def requests_for(tok, max_new: int = 12) -> list[Request]:
    reqs = [Request(tok.encode(p), max_new, (tok.eos_token_id,), True) for p in PROMPTS]
    reqs.append(Request(tok.encode("a prompt captured as it is"), 0, (tok.eos_token_id,), True))
    reqs.append(Request(tok.encode("generation without capture"), max_new, (tok.eos_token_id,), False))
    return reqs


def assert_same(ref, got, last_row_repeats: bool):
    assert [r.completion_ids for r in ref] == [g.completion_ids for g in got]
    for r, g in zip(ref, got):
        if r.features is None:
            assert g.features is None
            continue
        a, b = r.features, g.features
        assert (
            b.aux_hidden.dtype == torch.bfloat16
            and b.topk_ids.dtype == torch.int32
            and b.topk_logprobs.dtype == torch.float32
        )
        assert b.aux_hidden.shape == a.aux_hidden.shape and b.topk_ids.shape == a.topk_ids.shape
        n = a.aux_hidden.shape[0] - (1 if last_row_repeats and r.completion_ids else 0)
        torch.testing.assert_close(b.aux_hidden[:n].float(), a.aux_hidden[:n].float(), atol=1e-2, rtol=1e-2)
        assert torch.equal(b.topk_ids[:n], a.topk_ids[:n])
        torch.testing.assert_close(b.topk_logprobs[:n], a.topk_logprobs[:n], atol=1e-4, rtol=1e-4)
        if n < a.aux_hidden.shape[0]:
            assert torch.equal(b.aux_hidden[-1], b.aux_hidden[-2]) and torch.equal(b.topk_ids[-1], b.topk_ids[-2])


def test_aux_capture_server_one_request_matches_embedded(tiny, embedded):
    cfg, model, tok, ids = tiny
    reqs = requests_for(tok)
    ref = embedded.process(reqs, SAMPLING)
    with SGLangDouble(DoubleEngine(model, tok, aux_layer_ids=ids), version="0.5.23") as d:
        target = make_target(tiny, [d.url], concurrency=3, capture="auto")
        assert target._strategy(d.url) == "one_request"
        got = target.process(reqs, SAMPLING)
        assert d.requests == len(reqs)  # one request per sample
    assert_same(ref, got, last_row_repeats=True)


def test_eagle3_server_two_pass_matches_embedded_exactly(tiny, embedded, drafter):
    cfg, model, tok, ids = tiny
    reqs = requests_for(tok)
    ref = embedded.process(reqs, SAMPLING)
    with (
        SGLangDouble(DoubleEngine(model, tok, drafter=drafter), version="0.5.17") as d1,
        SGLangDouble(DoubleEngine(model, tok, drafter=drafter), version="0.5.17") as d2,
    ):
        target = make_target(tiny, [d1.url, d2.url], concurrency=2, capture="auto")
        assert target._strategy(d1.url) == "two_pass"
        got = target.process(reqs, SAMPLING)
        assert d1.requests > 0 and d2.requests > 0  # sharded over both servers
    assert_same(ref, got, last_row_repeats=False)


def test_server_that_cannot_give_aux_states_is_refused(tiny, embedded):
    cfg, model, tok, ids = tiny
    with SGLangDouble(DoubleEngine(model, tok), version="0.5.17") as plain:
        with pytest.raises(
            SGLangError, match=r"last layer only.*0\.5\.17 can: --speculative-algorithm EAGLE3 .*eagle3\)$"
        ):
            make_target(tiny, [plain.url])
    with SGLangDouble(DoubleEngine(model, tok), version="0.5.23") as plain:
        with pytest.raises(
            SGLangError, match=r"0\.5\.23 can: .*or aux capture without a draft \(serve.harvest_capture: aux_flag\)"
        ):
            make_target(tiny, [plain.url])
    with SGLangDouble(DoubleEngine(model, tok, aux_layer_ids=[0, 1, 1]), version="0.5.23") as wrong:
        with pytest.raises(SGLangError, match=r"captures layers \[0, 1, 1\]"):
            make_target(tiny, [wrong.url])
    with SGLangDouble(
        DoubleEngine(model, tok, aux_layer_ids=ids),
        version="0.5.23",
        server_args={"enable_return_hidden_states": False},
    ) as off:
        with pytest.raises(SGLangError, match="--enable-return-hidden-states"):
            make_target(tiny, [off.url])


def test_version_from_server_info_or_the_older_get_server_info(tiny):
    cfg, model, tok, ids = tiny
    with SGLangDouble(DoubleEngine(model, tok), version="0.5.17", server_info_paths=("/get_server_info",)) as d:
        si = server_info(d.url)
        assert si.version == (0, 5, 17) and not si.speculative and not si.returns_aux
    with SGLangDouble(DoubleEngine(model, tok, aux_layer_ids=ids), version="0.5.23") as d:
        si = server_info(d.url)
        assert si.version == (0, 5, 23) and si.aux_capture_ids == ids and si.returns_aux


def test_a_server_of_an_unsupported_version_is_named_before_the_harvest(tiny, caplog):
    cfg, model, tok, ids = tiny
    with SGLangDouble(DoubleEngine(model, tok, aux_layer_ids=ids), version="0.5.23") as d:
        d.version = "0.6.1"
        with caplog.at_level("WARNING", logger="eagle3ft.targets.sglang"):
            make_target(tiny, [d.url])
    assert f"{d.url}: SGLang 0.6.1 is not a supported version (0.5.17, 0.5.23)" in caplog.text
    assert "eagle3ft sglang-check" in caplog.text


# --------------------------------------------------------------------------- faults

FAST = {"timeout_s": 1.0, "retries": 2, "backoff_s": 0.01}


@pytest.fixture(scope="module")
def aux_double(tiny):
    cfg, model, tok, ids = tiny
    d = SGLangDouble(DoubleEngine(model, tok, aux_layer_ids=ids), version="0.5.23").start()
    d.fault_sleep_s = 2.0
    yield d
    d.stop()


@pytest.mark.parametrize("fault", ["500", "timeout", "close", "truncate"])
def test_faults_are_retried(tiny, embedded, aux_double, fault):
    _, _, tok, _ = tiny
    reqs = requests_for(tok)[:1]
    target = make_target(tiny, [aux_double.url], concurrency=1, **FAST)
    aux_double.faults.clear()
    aux_double.faults.append(fault)
    got = target.process(reqs, SAMPLING)
    assert target.stats.retries == 1 and not aux_double.faults
    assert_same(embedded.process(reqs, SAMPLING), got, last_row_repeats=True)


@pytest.mark.parametrize("fault", ["500", "timeout", "close", "truncate"])
def test_persistent_faults_fail_clearly(tiny, embedded, aux_double, fault):
    _, _, tok, _ = tiny
    target = make_target(tiny, [aux_double.url], concurrency=1, **FAST)
    aux_double.faults.clear()
    aux_double.faults.extend([fault] * (FAST["retries"] + 1))
    with pytest.raises(SGLangError, match=r"request 0 failed at http://127\.0\.0\.1:\d+ after 3 attempts"):
        target.process(requests_for(tok)[:1], SAMPLING)
    assert not aux_double.faults


def test_refused_connection_fails_clearly(tiny, embedded, aux_double):
    _, _, tok, _ = tiny
    target = make_target(tiny, [aux_double.url], concurrency=1, **FAST)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connections are refused
        target.urls = [dead]
        target.servers[dead] = target.servers[aux_double.url]
        with pytest.raises(SGLangError, match="after 3 attempts: connection failed"):
            target.process(requests_for(tok)[:1], SAMPLING)
        with pytest.raises(SGLangError, match="after 2 attempts"):
            server_info(dead)


def test_bad_request_is_not_retried(tiny, embedded, drafter):
    cfg, model, tok, ids = tiny
    with SGLangDouble(DoubleEngine(model, tok, drafter=drafter), version="0.5.17") as d:
        target = make_target(tiny, [d.url], concurrency=1, capture="one_request", **FAST)
        with pytest.raises(SGLangError, match="HTTP 400.*Either text or input_ids"):
            sglang_http.call(
                d.url, "/generate", {"sampling_params": {"max_new_tokens": 4}}, target.policy, what="request 0"
            )
        assert d.requests == 1


def test_client_reads_the_real_flat_decode_layout(tiny, embedded):
    """The real 0.5.17 server sends each decode step's hidden row flat ([W], not [[W]]:
    tests/fixtures/sglang-0.5.17); the double now does too, and the client's features match the embedded target's."""
    cfg, model, tok, ids = tiny
    reqs = requests_for(tok)[:1]
    ref = embedded.process(reqs, SAMPLING)
    with SGLangDouble(DoubleEngine(model, tok, aux_layer_ids=ids), version="0.5.23") as d:
        raw = requests.post(
            d.url + "/generate",
            json={
                "input_ids": reqs[0].prompt_ids,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True},
                "return_hidden_states": True,
            },
            timeout=60,
        ).json()
        hs = raw["meta_info"]["hidden_states"]
        assert len(hs) == 5 and len(hs[0]) == len(reqs[0].prompt_ids)
        assert all(len(e) == 3 * model.config.hidden_size and all(isinstance(x, float) for x in e) for e in hs[1:])
        got = make_target(tiny, [d.url], capture="one_request").process(reqs, SAMPLING)
    assert_same(ref, got, last_row_repeats=True)


# --------------------------------------------------------------------------- the decoder


def _body(rows: np.ndarray, flat_decode_rows: bool, prompt_rows: int) -> bytes:
    block = rows[:prompt_rows].tolist()
    dec = [r if flat_decode_rows else [r] for r in rows[prompt_rows:].tolist()]
    meta = {
        "id": "x",
        "input_top_logprobs": [None, [[-0.5, 7, None], [-1.5, 3, None]]],
        "hidden_states": [block] + dec,
        "completion_tokens": 3,
        "e2e_latency": 0.1,
    }
    return json.dumps({"text": 'a]}b],"c', "output_ids": [1, 2, 3], "meta_info": meta}, separators=(",", ":")).encode()


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("chunk,n,width", [(1, 9, 6), (7, 9, 6), (64, 9, 6), (1 << 20, 9, 6), (1 << 20, 300, 192)])
def test_hidden_stream_any_chunking(flat, chunk, n, width):
    rows = torch.randn(n, width).to(torch.bfloat16).float().numpy()
    if n * width * 8 > sglang_http.ARROW_MIN_BYTES:
        assert sglang_http._pa is not None  # the large case goes through pyarrow's parser
    body = _body(rows, flat, 6)
    s = HiddenStream(width=width, rows_hint=2)
    for a in range(0, len(body), chunk):
        s.feed(body[a : a + chunk])
    doc, hidden = s.finish()
    assert np.array_equal(hidden, rows)
    assert (
        doc["meta_info"]["hidden_states"] is None
        and doc["text"] == 'a]}b],"c'
        and doc["meta_info"]["e2e_latency"] == 0.1
    )
    assert doc == {**json.loads(body), "meta_info": {**json.loads(body)["meta_info"], "hidden_states": None}}


def test_hidden_stream_rejects_truncation_and_non_numbers():
    body = _body(np.ones((3, 4), np.float32), False, 2)
    s = HiddenStream(width=4)
    s.feed(body[: body.index(b"hidden_states") + 40])
    with pytest.raises(RetryableError, match="truncated"):
        s.finish()
    s = HiddenStream(width=4)
    s.feed(body[: len(body) - 5])
    with pytest.raises(RetryableError, match="not complete JSON"):
        s.finish()
    s = HiddenStream(width=4)
    with pytest.raises(SGLangError, match="not a number"):
        s.feed(body.replace(b"[[[1.0,", b"[[[null,"))
    big = _body(np.ones((4000, 4), np.float32), False, 2).replace(b"[[[1.0,", b"[[[null,")
    with pytest.raises(SGLangError, match="not a number"):
        HiddenStream(width=4).feed(big)
    s = HiddenStream(width=5)
    s.feed(body)
    with pytest.raises(SGLangError, match="multiple of the row width 5"):
        s.finish()


def test_topk_arrays_sorts_and_checks_k():
    ids, lps = topk_arrays([[[-2.0, 5, None], [-0.1, 9, None]], [[-0.3, 1, None], [-0.4, 2, None]]], 2)
    assert ids.tolist() == [[9, 5], [1, 2]] and lps.dtype == np.float32 and lps[0, 0] == np.float32(-0.1)
    with pytest.raises(SGLangError, match="expected 3"):
        topk_arrays([[[-2.0, 5, None]]], 3)
