"""Live benchmark harness on the tiny target with an exported (random) drafter, then the report."""

import json

import pytest
import torch

from eagle3ft.config import load_config
from eagle3ft.data.render import load_prompt_sets
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.export import export_drafter
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.eval.bench import live, schedule
from eagle3ft.eval.bench.backend import BenchBackend
from eagle3ft.eval.bench.format import format_summary
from eagle3ft.eval.bench.summary import summarize
from eagle3ft.eval.report.build import build as build_report
from eagle3ft.setting import Setting


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("bench")
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_json("configs/drafters/tiny.json"))
    drafter.t2d[: drafter.config.draft_vocab_size] = (
        True  # d2t 0: draft id i is target id i (the bench checks the vocab)
    )
    export_drafter(drafter, run / "export")
    cfg = load_config(
        "configs/tiny.yaml",
        [
            "bench.prompts.limit=2",
            "bench.max_new_tokens=6",
            "bench.repetitions=2",
            "bench.settings=[{steps: 1, topk: 1, num_draft_tokens: 2}, {steps: 3, topk: 1, num_draft_tokens: 4}]",
        ],
    )
    backend = live.make_backend(cfg, run)
    summary = schedule.run(
        cfg.eval,
        cfg.bench,
        run,
        backend,
        load_prompt_sets(cfg.target, cfg.bench, backend.tokenizer),
        log=lambda *a: None,
    )
    return run, cfg, backend, summary


def test_runs_are_interleaved_and_complete(bench_run):
    run, _, backend, _ = bench_run
    assert isinstance(backend, BenchBackend)
    rows = [json.loads(x) for x in (run / "bench" / "runs.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 3 * 2  # repetitions x (baseline + 2 settings) x prompts
    order = [(r["repetition"], r["mode"], r["setting"]) for r in rows[::2]]
    assert order == [
        (rep, m, s)
        for rep in range(2)
        for m, s in [("baseline", None), ("speculative", "1/1/2"), ("speculative", "3/1/4")]
    ]
    for r in rows:
        assert r["new_tokens"] <= 6 and r["decode_s"] > 0
        if r["mode"] == "speculative":
            assert r["verify_count"] == len(r["accept_lengths"]) == len(r["verify_s"])


def test_summary(bench_run):
    _, _, _, s = bench_run
    env = s["environment"]
    for k in ("device", "cpu_model", "torch", "transformers", "torch_threads", "code_version"):
        assert env[k]
    b = s["baseline"]["tok_s"]
    assert b["min"] <= b["median"] <= b["max"] and len(b["per_repetition"]) == 2
    for row in s["speculative"]:
        assert row["outputs_match_baseline"] == 1.0  # greedy speculation reproduces plain greedy
        assert 1.0 <= row["tau"] <= row["setting"]["steps"] + 1
        assert row["verify_ms"] > 0 and row["draft_forward_ms"] > 0
    assert sorted(int(k) for k in s["costs"]["verify_s"]) == [1, 2, 3, 4, 5, 6]


def test_embedded_backend_refuses_trees(bench_run):
    _, _, backend, _ = bench_run
    with pytest.raises(ValueError, match="chains only"):
        backend.run_speculative([[1, 2, 3]], Setting(3, 2, 6), 4)


def test_summarize_without_verify_curve_uses_cycles():
    def row(rep, mode, key, decode_s, accepts):
        return {
            "repetition": rep,
            "mode": mode,
            "setting": key,
            "prompt_index": 0,
            "prompt_tokens": 5,
            "new_tokens": 11,
            "prefill_s": 0.1,
            "decode_s": decode_s,
            "output_ids": None,
            "verify_count": len(accepts) if accepts else None,
            "accept_lengths": accepts,
            "verify_s": None,
            "draft_forward_s": None,
            "cycle_s": None,
        }

    runs = [
        row(0, "baseline", None, 1.0, None),
        row(0, "speculative", "3/1/4", 0.5, [2, 3, 2, 3]),
        row(1, "baseline", None, 2.0, None),
        row(1, "speculative", "3/1/4", 0.4, [2, 3, 2, 3]),
    ]
    s = summarize(runs, [Setting(3, 1, 4)], None)
    assert s["baseline"]["tok_s"]["per_repetition"] == [10.0, 5.0]
    assert s["costs"]["baseline_s_per_token"] == pytest.approx(0.15)  # median of 0.1 and 0.2
    sp = s["speculative"][0]
    assert sp["tau"] == 2.5 and sp["cycle_s"] == pytest.approx(0.9 / 8)
    assert s["costs"]["verify_s"] == {"4": pytest.approx(0.9 / 8)} and s["costs"]["draft_forward_s"] == 0.0


def test_report_joins_everything(bench_run):
    run, _, _, _ = bench_run
    rep = build_report(run)
    assert set(rep["plots"]) == {"tau_offline_vs_live", "tok_s_vs_draft_tokens"}
    for name in rep["plots"].values():
        assert (run / "eval" / name).stat().st_size > 10_000
    md = (run / "eval" / "report.md").read_text()
    assert "tau live" in md and "no train/metrics.jsonl" in md and "no eval/accept_len.json" in md
    assert rep["headline"]["baseline_tok_s"] == rep["bench"]["baseline"]["tok_s_median"]


def test_costs_are_medians_so_a_slow_pass_does_not_move_them():
    """One slow pass (a cold server, a collection pause) must not shift the cycle costs the economics use."""

    def row(rep, mode, setting, decode_s, cycle=None, verifies=None):
        n = 33
        spec = mode == "speculative"
        return {
            "repetition": rep,
            "mode": mode,
            "setting": setting,
            "prompt_index": 0,
            "prompt_tokens": 10,
            "new_tokens": n,
            "prefill_s": 0.01,
            "decode_s": decode_s,
            "output_ids": None,
            "verify_count": verifies if spec else None,
            "accept_lengths": [2] * verifies if spec and verifies else None,
            "verify_s": [cycle * 0.8] * verifies if cycle else None,
            "draft_forward_s": [cycle * 0.05] * (3 * verifies) if cycle else None,
            "cycle_s": [cycle] * verifies if cycle else None,
        }

    st = Setting(3, 1, 4)
    timed = [row(r, "baseline", None, 0.32) for r in range(3)]
    timed += [row(0, "speculative", st.key, 0.8, cycle=0.05, verifies=16)] + [
        row(r, "speculative", st.key, 0.16, cycle=0.01, verifies=16) for r in (1, 2)
    ]
    s = summarize(timed, [st], None)
    assert s["speculative"][0]["cycle_s"] == pytest.approx(0.01) and s["costs"]["verify_s"]["4"] == pytest.approx(0.008)
    whole_cycle = [
        {**r, "verify_s": None, "draft_forward_s": None, "cycle_s": None} for r in timed
    ]  # what SGLang gives
    s = summarize(whole_cycle, [st], None)
    assert s["speculative"][0]["cycle_s"] == pytest.approx(0.16 / 16) and s["costs"]["verify_s"]["4"] == pytest.approx(
        0.01
    )


def test_several_drafters_and_prompt_sets_in_one_interleaved_run(tmp_path):
    """bench.drafters and bench.more_prompts: per repetition and prompt set, plain then each drafter; the top level
    of summary.json stays eval.checkpoint on bench.prompts."""
    for i, folder in enumerate((tmp_path / "export", tmp_path / "other")):
        torch.manual_seed(i)
        drafter = Eagle3Drafter(DrafterConfig.from_json("configs/drafters/tiny.json"))
        drafter.t2d[: drafter.config.draft_vocab_size] = True
        export_drafter(drafter, folder)
    cfg = load_config(
        "configs/tiny.yaml",
        [
            "bench.prompts.limit=1",
            "bench.more_prompts=[{kind: humaneval, limit: 1}, {kind: mtbench, limit: 1}]",
            f"bench.drafters={{other: '{tmp_path / 'other'}'}}",
            "bench.max_new_tokens=5",
            "bench.repetitions=2",
        ],
    )
    backend = live.make_backend(cfg, tmp_path)
    s = schedule.run(
        cfg.eval,
        cfg.bench,
        tmp_path,
        backend,
        load_prompt_sets(cfg.target, cfg.bench, backend.tokenizer),
        log=lambda *a: None,
    )
    rows = [json.loads(x) for x in (tmp_path / "bench" / "runs.jsonl").read_text().splitlines()]
    sets = ["mtbench", "humaneval", "mtbench-2"]
    assert [(r["repetition"], r["prompts"], r["drafter"]) for r in rows] == [
        (rep, p, d) for rep in range(2) for p in sets for d in (None, "export", "other")
    ]
    assert list(s["prompt_sets"]) == sets
    top = s["prompt_sets"]["mtbench"]
    assert s["speculative"] == top["drafters"]["export"]["speculative"] and s["baseline"] == top["baseline"]
    assert s["offline_same_prompts"] == top["drafters"]["export"]["offline_same_prompts"]
    for p in s["prompt_sets"].values():
        assert p["count"] == 1 and list(p["drafters"]) == ["export", "other"]
        assert p["drafters"]["other"]["checkpoint"] == str(tmp_path / "other")
        for d in p["drafters"].values():
            assert d["speculative"][0]["outputs_match_baseline"] == 1.0 and d["offline_same_prompts"]["samples"] == 1
    assert "drafter other" in format_summary(s)


def test_sglang_backend_refuses_more_drafters(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["bench.backend=sglang", f"bench.drafters={{other: '{tmp_path}'}}"])
    with pytest.raises(ValueError, match="benches one drafter"):
        live.make_backend(cfg, tmp_path)
