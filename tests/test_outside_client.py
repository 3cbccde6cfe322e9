"""benchmarks/outside_client.py's request-by-request alternation: the rows against protocol doubles (our two clients;
bench_serving's needs SGLang, which does not install here), and the summary on hand-made rows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from eagle3ft.config import REPO_ROOT

sys.path.insert(0, str(Path(__file__).parent))
from test_sglang_bench import doubles, tiny  # noqa: E402,F401  (module fixtures: the tiny target and its two doubles)

_spec = importlib.util.spec_from_file_location("outside_client", REPO_ROOT / "benchmarks/outside_client.py")
oc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oc)


def row(arm, client, prompt, tokens, seconds, rep=0, **kw):
    return {"rep": rep, "prompt": prompt, "arm": arm, "client": client, "tokens": tokens, "seconds": seconds, **kw}


def test_tau_and_the_no_loop_answers_per_arm():
    rows = [
        row("new", "ours", 0, 101, 1.0, verifies=25, loops=True),
        row("new", "ours", 1, 51, 1.0, verifies=25, loops=False),
    ]
    a = oc.summarize(rows)["arms"]["new"]["ours"]
    assert a["tau"] == pytest.approx(150 / 50)
    assert a["no_loop_answers"] == {"answers": 1, "tau": pytest.approx(2.0)}


def test_summary_of_known_rows():
    rows = [
        row("baseline", "bench_serving", 0, 100, 1.0),
        row("baseline", "ours", 0, 100, 1.25),  # 20% slower on the same answer
        row("baseline", "bench_serving", 1, 200, 1.0),
        row("baseline", "ours", 1, 150, 1.0),  # another answer length
        row("8/4/32", "bench_serving", 0, 100, 0.5),
        row("8/4/32", "ours", 0, 100, 0.5),
        row("8/4/32", "bench_serving", 1, 200, 0.5),
        row("8/4/32", "ours", 1, 150, 0.5),
    ]
    s = oc.summarize(rows)
    assert s["reference"] == "bench_serving"
    base = s["arms"]["baseline"]
    assert base["bench_serving"]["tok_s"] == pytest.approx(150.0)
    assert base["ours"]["tok_s"] == pytest.approx(250 / 2.25)
    vs = base["ours"]["vs_bench_serving"]
    assert vs["total"] == pytest.approx((250 / 2.25) / 150 - 1)
    assert vs["per_request"]["n"] == 2
    assert vs["per_request"]["min"] == pytest.approx(-0.25)
    assert vs["same_length_share"] == 0.5
    assert vs["same_length_total"] == pytest.approx(0.8 - 1)
    assert not vs["within_5pct"]
    sp = s["speedup"]["8/4/32"]
    assert sp["bench_serving"] == pytest.approx(2.0)
    assert sp["ours"] == pytest.approx((250 / 1.0) / (250 / 2.25))
    assert sp["ours_vs_bench_serving"] == pytest.approx(sp["ours"] / 2.0 - 1)


def test_order_rotates_and_every_request_follows_a_flush():
    flushed, seen = [], []

    def requester(name):
        def f(url, text, ids, n):
            seen.append((name, url, flushed[-1]))
            return {"tokens": n, "seconds": 1.0}

        return f

    reqs = {c: requester(c) for c in ("a", "b", "c")}
    rows = oc.alternate_rows({"baseline": "u0", "x": "u1"}, ["t0", "t1", "t2"], [[1], [2], [3]], reqs, 4, 2,
                             flushed.append)  # fmt: skip
    assert len(rows) == 2 * 3 * 2 * 3
    assert all(url == last for _, url, last in seen)  # the flush just before each request was its own server's
    firsts = [r["client"] for r in rows if r["position"] == 0 and r["arm"] == "baseline" and r["rep"] == 0]
    assert firsts == ["a", "b", "c"]


def alternate_on_doubles(servers, tmp_path, monkeypatch, clients: str) -> dict:
    """`prompts` then `alternate` through main(), plain and 3/1/4 on the two doubles, 2 prompts, 8 tokens."""
    base, spec = servers
    p = tmp_path / "prompts.json"
    monkeypatch.setattr(
        sys,
        "argv",
        ["outside_client.py", "prompts", "--config", str(REPO_ROOT / "configs/tiny.yaml"),
         "--set", "bench.prompts={kind: mtbench, limit: 2}", "--out", str(p)],
    )  # fmt: skip
    oc.main()
    monkeypatch.setattr(
        sys,
        "argv",
        ["outside_client.py", "alternate", "--prompts", str(p), "--tokenizer", "unused", "--arm", f"baseline={base.url}",
         "--arm", f"3/1/4={spec.url}", "--clients", clients, "--output-len", "8", "--out", str(tmp_path)],
    )  # fmt: skip
    oc.main()
    return json.loads((tmp_path / "alternate.json").read_text())


def test_our_clients_against_the_doubles(tiny, doubles, tmp_path, monkeypatch, capsys):  # noqa: F811
    s = alternate_on_doubles(doubles, tmp_path, monkeypatch, "ours,ours-text")
    lines = (tmp_path / "alternate.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * 2
    assert s["reference"] == "ours"
    for arm in ("baseline", "3/1/4"):
        assert s["arms"][arm]["ours"]["tokens"] > 0
        assert s["arms"][arm]["ours-text"]["tok_s"] > 0
        assert "tok_s_server" in s["arms"][arm]["ours"]  # the server's own e2e_latency
    assert s["arms"]["baseline"]["ours-text"]["vs_ours"]["same_length_share"] == 1.0  # one server state, one answer
    assert "3/1/4" in s["speedup"]
    spec = s["arms"]["3/1/4"]["ours"]
    assert spec["tau"] >= 1.0 and "tau" not in s["arms"]["baseline"]["ours"]  # a plain server verifies nothing


def test_streamed_client_against_the_doubles(tiny, doubles, tmp_path, monkeypatch):  # noqa: F811
    """ours-stream beside ours, request by request: the same answers, tau from the same counters, decode-only tok/s."""
    s = alternate_on_doubles(doubles, tmp_path, monkeypatch, "ours,ours-stream")
    for arm in ("baseline", "3/1/4"):
        st = s["arms"][arm]["ours-stream"]
        assert st["vs_ours"]["same_length_share"] == 1.0
        assert st["tok_s_after_first"] > 0 and "tok_s_after_first" not in s["arms"][arm]["ours"]
    assert s["arms"]["3/1/4"]["ours-stream"]["tau"] == pytest.approx(s["arms"]["3/1/4"]["ours"]["tau"])
    rows = [json.loads(x) for x in (tmp_path / "alternate.jsonl").read_text().splitlines()]
    assert all(r["events"] >= 1 and r["ttft_s"] <= r["seconds"] for r in rows if r["client"] == "ours-stream")


def test_an_unknown_client_is_one_line(tmp_path, monkeypatch):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"texts": [], "ids": [], "stop_ids": [2]}))
    monkeypatch.setattr(
        sys,
        "argv",
        ["outside_client.py", "alternate", "--prompts", str(p), "--tokenizer", "x", "--arm", "baseline=http://127.0.0.1:1",
         "--clients", "ours,bogus", "--out", str(tmp_path / "o")],
    )  # fmt: skip
    with pytest.raises(SystemExit, match=r"--clients: unknown \['bogus'\]"):
        oc.main()
