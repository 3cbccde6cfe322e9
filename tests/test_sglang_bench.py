"""The live bench's sglang backend against protocol doubles: tau and tok/s from the servers' metadata."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from eagle3ft.config import REPO_ROOT, load_config
from eagle3ft.data.render import load_prompt_sets
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.export import export_drafter
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.eval.bench import schedule
from eagle3ft.eval.bench.sglang_backend import SGLangBackend, run_concurrency
from eagle3ft.eval.bench.sglang_requests import accept_lengths_from
from eagle3ft.eval.decode.speculate import SpeculativeDecoder
from eagle3ft.eval.economics.analysis import after_bench, offline_tau_by_setting
from eagle3ft.eval.offline import same_prompts
from eagle3ft.eval.offline.same_prompts import offline_tau
from eagle3ft.setting import Setting
from eagle3ft.targets.hf import load_target
from eagle3ft.targets.sglang_http import SGLangError

sys.path.insert(0, str(Path(__file__).parent))
from free_ports import free_ports  # noqa: E402
from sglang_double import DoubleEngine, SGLangDouble  # noqa: E402

_spec = importlib.util.spec_from_file_location("tau_per_prompt", REPO_ROOT / "benchmarks/tau_per_prompt.py")
tau_per_prompt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tau_per_prompt)

BENCH = [
    "bench.backend=sglang",
    "bench.prompts={kind: mtbench, limit: 2}",
    "bench.max_new_tokens=16",
    "bench.repetitions=2",
    "bench.settings=[{steps: 3, topk: 1, num_draft_tokens: 4}]",
]


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(REPO_ROOT / "configs/tiny.yaml")
    model, tok = load_target(cfg.target)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        d = Eagle3Drafter(DrafterConfig.from_json(REPO_ROOT / cfg.drafter.config))
    with torch.no_grad():
        d.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        common = torch.arange(d.config.draft_vocab_size)  # draft id i -> target id i: the tokenizer's first ids
        d.d2t.zero_()
        d.t2d.zero_()
        d.t2d[common] = True
    return cfg, model, tok, d.eval()


@pytest.fixture(scope="module")
def doubles(tiny):
    _, model, tok, drafter = tiny
    base = SGLangDouble(DoubleEngine(model, tok), version="0.5.17").start()
    spec = SGLangDouble(
        DoubleEngine(model, tok, drafter=drafter, spec_steps=3, spec_topk=1, spec_num_draft_tokens=4), version="0.5.17"
    ).start()
    yield base, spec
    base.stop()
    spec.stop()


@pytest.mark.slow
def runs_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "bench/runs.jsonl").read_text().splitlines()]


def test_bench_through_sglang_doubles(tiny, doubles, tmp_path, monkeypatch, capsys):
    cfg0, model, tok, drafter = tiny
    base, spec = doubles
    export_drafter(drafter, tmp_path / "export")  # the double's drafter: what bench.sglang.same_prompts evaluates
    cfg = load_config(
        REPO_ROOT / "configs/tiny.yaml",
        BENCH
        + [
            f"bench.sglang.baseline_url={base.url}",
            f"bench.sglang.speculative_url={spec.url}",
            "bench.concurrency=[1, 2]",
            "bench.sglang.same_prompts=true",
            f"eval.checkpoint={tmp_path / 'export'}",
        ],
    )
    backend = SGLangBackend(cfg, tmp_path)
    sets = load_prompt_sets(cfg.target, cfg.bench, backend.tokenizer)
    prompts = sets[0].prompts
    summary = schedule.run(cfg.eval, cfg.bench, tmp_path, backend, sets, log=lambda *_: None)
    after_bench(tmp_path, cfg.bench, cfg.target, log=lambda *_: None)

    # offline tau on the plain server's own answers: what eval/offline/same_prompts.py gives for those tokens in-process
    answers = [r["output_ids"] for r in runs_of(tmp_path) if r["mode"] == "baseline" and r["repetition"] == 0]
    want = offline_tau(model, drafter, drafter.config.aux_layer_ids, prompts, answers, [Setting(3, 1, 4)])
    got = summary["offline_same_prompts"]
    assert got["roots"] == want["roots"] > 0 and got["settings"] == pytest.approx(want["settings"])

    # the same from the command, in another run folder, before any bench there: a prediction's input
    overrides = BENCH + [f"eval.checkpoint={tmp_path / 'export'}"]
    other = tmp_path / "other"
    same_prompts.main(
        ["--config", str(REPO_ROOT / "configs/tiny.yaml"), "--run-dir", str(other), "--answers-from", str(tmp_path)]
        + [a for o in overrides for a in ("--set", o)]
    )
    assert offline_tau_by_setting(other / "eval/accept_len.json") == pytest.approx(want["settings_walk"])
    doc = json.loads((other / "eval/accept_len.json").read_text())  # and on the answers that finished before the cap
    plain0 = [r for r in runs_of(tmp_path) if r["mode"] == "baseline" and r["repetition"] == 0]
    assert doc["finished_answers"] == sum(bool(r["finished"]) for r in plain0)
    assert all((v["tau_walk_finished"] is None) == (doc["finished_answers"] == 0) for v in doc["settings"].values())
    # and on the speculative pass's own answers, which greedy speculation on the CPU keeps equal to the plain ones
    own = tmp_path / "own"
    same_prompts.main(
        ["--config", str(REPO_ROOT / "configs/tiny.yaml"), "--run-dir", str(own), "--answers-from", str(tmp_path)]
        + ["--answers-of", "3/1/4"]
        + [a for o in overrides for a in ("--set", o)]
    )
    assert "3/1/4 greedy answers" in json.loads((own / "eval/accept_len.json").read_text())["source"]
    assert offline_tau_by_setting(own / "eval/accept_len.json") == pytest.approx(want["settings_walk"])

    # benchmarks/tau_per_prompt.py, prompt by prompt: the same walks, and the live cycles of repetition 0
    argv = ["tau_per_prompt.py", "--config", str(REPO_ROOT / "configs/tiny.yaml"), "--run", str(tmp_path)]
    argv += ["--setting", "3/1/4", "--leave-out", "1"] + [a for o in overrides for a in ("--set", o)]
    monkeypatch.setattr(sys, "argv", argv)
    capsys.readouterr()
    tau_per_prompt.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    per_prompt, totals, cycles, without = lines[:-3], lines[-3], lines[-2], lines[-1]
    assert [p["prompt"] for p in per_prompt] == [0, 1] and all(p["part_at"] == p["plain_tokens"] for p in per_prompt)
    assert totals["tau_plain"] == pytest.approx(want["settings_walk"]["3/1/4"]) == totals["tau_own"]
    live_rep0 = [r for r in runs_of(tmp_path) if r["mode"] == "speculative" and r["repetition"] == 0]
    assert cycles["cycles"]["live"] == sum(r["verify_count"] for r in live_rep0)
    assert cycles["tokens"]["live"] == sum(sum(r["accept_lengths"]) for r in live_rep0)
    assert all(sum(v) == pytest.approx(1.0, abs=0.01) for v in cycles["share_by_tokens_emitted"].values())
    assert without["without"] == [1] and without["tau_live"] == per_prompt[0]["live"]

    # tau: the same greedy decodes by the embedded speculative decoder, counted the same way
    dec = SpeculativeDecoder(model, drafter, drafter.config.aux_layer_ids, 3, 0.0, backend.eos_ids)
    gens = [dec.generate(p, cfg.bench.max_new_tokens) for p in prompts]
    (row,) = summary["speculative"]
    assert row["verify_count"] == cfg.bench.repetitions * sum(g.verify_count for g in gens)
    assert row["tau"] == pytest.approx(sum(sum(g.accept_lengths) for g in gens) / sum(g.verify_count for g in gens))
    assert row["outputs_match_baseline"] == 1.0  # greedy speculation returns the plain greedy tokens
    assert row["tok_s_median"] > 0 and summary["baseline"]["tok_s_median"] > 0

    runs = runs_of(tmp_path)
    for r in runs:
        assert (
            r["tok_s"] == pytest.approx((r["new_tokens"] - 1) / r["decode_s"])
            if r["decode_s"] > 0
            else r["new_tokens"] <= 1
        )
    spec_runs = [r for r in runs if r["mode"] == "speculative"]
    assert [r["output_ids"] for r in spec_runs[: len(gens)]] == [g.tokens for g in gens]

    env = summary["environment"]
    taus = env["sglang_tau"]["3/1/4"]
    served = spec.engine.spec_tokens / spec.engine.spec_verifies  # the double's lifetime average, as SGLang's
    assert taus["server_avg_spec_accept_length"][-1] == pytest.approx(served)
    assert (
        env["servers"]["3/1/4"]["speculative_num_draft_tokens"] == 4
        and env["servers"]["baseline"]["version"] == "0.5.17"
    )
    requests_log = [json.loads(line) for line in (tmp_path / "bench/sglang_requests.jsonl").read_text().splitlines()]
    assert {r["setting"] for r in requests_log} == {"baseline", "3/1/4"} and all(
        "spec_correct_drafts_histogram" in r for r in requests_log if r["setting"] != "baseline"
    )  # the key both versions send (0.5.23 dropped its twin spec_accept_histogram)
    assert env["speculative_sampling"] == {}  # greedy: the sampled-verification settings do not apply

    econ = json.loads((tmp_path / "bench/economics.json").read_text())
    assert econ and summary["costs"]["verify_s"]["4"] > 0  # cycle time measured from the server per setting

    conc = run_concurrency(cfg.bench, tmp_path, backend, prompts, log=lambda *_: None)
    level = conc["levels"]["2"]
    assert level["baseline"]["tok_s"]["median"] > 0 and level["3/1/4"]["tau"] == pytest.approx(
        sum(len(g.tokens) for g in gens) / sum(g.verify_count for g in gens)
    )
    assert json.loads((tmp_path / "bench/concurrency.json").read_text())["levels"]["2"]["3/1/4"]["runs"]
    backend.close()


def test_eagle3ft_bench_runs_the_concurrency_sweep(doubles, tmp_path, capsys, monkeypatch):
    """`eagle3ft bench --set bench.concurrency=[1,2]`: the bench, its economics, then the levels above 1."""
    from eagle3ft.commands import main

    monkeypatch.setattr(sys, "argv", ["eagle3ft"])  # main names the stage there
    base, spec = doubles
    sets = BENCH + [f"bench.sglang.baseline_url={base.url}", f"bench.sglang.speculative_url={spec.url}"]
    sets += ["bench.concurrency=[1,2]", "bench.repetitions=1"]
    run = tmp_path / "run"
    run.mkdir()  # servers benched alone: the read-side stages do not create a run folder (eagle3ft/cli.py)
    with pytest.raises(SystemExit) as e:
        main(
            ["bench", "--config", str(REPO_ROOT / "configs/tiny.yaml"), "--run-dir", str(run)]
            + sum((["--set", x] for x in sets), [])
        )
    assert e.value.code in (0, None), capsys.readouterr().err[-2000:]
    levels = json.loads((run / "bench/concurrency.json").read_text())["levels"]
    assert list(levels) == ["2"] and levels["2"]["3/1/4"]["tok_s"]["median"] > 0
    assert (run / "bench/summary.json").is_file() and (run / "bench/economics.json").is_file()


def test_speculative_url_serves_only_its_setting(tiny, doubles, tmp_path):
    base, spec = doubles
    cfg = load_config(
        REPO_ROOT / "configs/tiny.yaml",
        BENCH + [f"bench.sglang.baseline_url={base.url}", f"bench.sglang.speculative_url={spec.url}"],
    )
    backend = SGLangBackend(cfg, tmp_path)
    with pytest.raises(SGLangError, match=f"no server given for EAGLE3 2/1/3 \\({spec.url} serves EAGLE3 3/1/4\\)"):
        backend.url(Setting(2, 1, 3))
    cfg.bench.sglang.baseline_url = spec.url
    with pytest.raises(SGLangError, match="the baseline must be plain"):
        backend.url(None)
    backend.close()


def test_each_setting_runs_on_the_listed_server_that_serves_it(tiny, doubles, tmp_path):
    _, model, tok, drafter = tiny
    base, spec = doubles
    engine = DoubleEngine(model, tok, drafter=drafter, spec_steps=2, spec_topk=1, spec_num_draft_tokens=3)
    spec2 = SGLangDouble(engine, version="0.5.17").start()
    try:
        sets = [f"bench.sglang.baseline_url={base.url}", f"bench.sglang.speculative_urls=[{spec2.url}, {spec.url}]"]
        backend = SGLangBackend(load_config(REPO_ROOT / "configs/tiny.yaml", BENCH + sets), tmp_path)
        assert backend.url(Setting(3, 1, 4)) == spec.url and backend.url(Setting(2, 1, 3)) == spec2.url
        assert backend.url(None) == base.url
        assert backend.infos["2/1/3"]["speculative_num_steps"] == 2
        with pytest.raises(SGLangError, match="add it to bench.sglang.speculative_urls"):
            backend.url(Setting(5, 1, 6))
        backend.close()
    finally:
        spec2.stop()


def test_sampled_bench_records_the_servers_verify_settings(tiny, doubles, tmp_path):
    """At T > 0, tau moves with the server's sampled-verification settings: summary.json keeps them per setting."""
    cfg0, model, tok, drafter = tiny
    base, _ = doubles
    spec = SGLangDouble(
        DoubleEngine(model, tok, drafter=drafter, spec_steps=3, spec_topk=1, spec_num_draft_tokens=4), version="0.5.23"
    ).start()
    try:
        sets = [
            f"bench.sglang.baseline_url={base.url}",
            f"bench.sglang.speculative_url={spec.url}",
            "bench.temperature=0.8",
            "bench.prompts={kind: mtbench, limit: 1}",
            "bench.max_new_tokens=8",
            "bench.repetitions=1",
            "bench.sglang.requests=[whole]",
        ]
        cfg = load_config(REPO_ROOT / "configs/tiny.yaml", BENCH + sets)
        backend = SGLangBackend(cfg, tmp_path)
        schedule.run(
            cfg.eval,
            cfg.bench,
            tmp_path,
            backend,
            load_prompt_sets(cfg.target, cfg.bench, backend.tokenizer),
            log=lambda *_: None,
        )
        backend.close()
    finally:
        spec.stop()
    summary = json.loads((tmp_path / "bench/summary.json").read_text())
    assert summary["temperature"] == 0.8
    assert summary["environment"]["speculative_sampling"] == {
        "3/1/4": {
            "speculative_accept_threshold_single": 1.0,
            "speculative_accept_threshold_acc": 1.0,
            "speculative_use_rejection_sampling": False,
            "speculative_use_block_verification": False,
        }
    }


def test_accept_lengths_from_histogram_or_counts():
    assert accept_lengths_from({"spec_verify_ct": 3, "spec_correct_drafts_histogram": [1, 0, 2, 0]}, 8) == [1, 3, 3]
    assert accept_lengths_from({"spec_verify_ct": 3, "spec_accept_histogram": [1, 0, 2, 0]}, 8) == [1, 3, 3]
    assert sorted(accept_lengths_from({"spec_verify_ct": 3}, 8)) == [2, 2, 3]
    assert accept_lengths_from({"spec_verify_ct": 0}, 8) is None and accept_lengths_from({}, 8) is None


@pytest.mark.slow
def test_bench_launches_and_stops_its_servers(tiny, tmp_path):
    """bench.sglang.launch: baseline and EAGLE3 servers started from serve (the double as the server program), one at a
    time."""
    cfg0, model, tok, drafter = tiny
    export_drafter(drafter, tmp_path / "export")
    port = free_ports(2)  # the baseline on port, the speculative server on port + 1
    cfg = load_config(
        REPO_ROOT / "configs/tiny.yaml",
        BENCH
        + [
            "bench.sglang.launch=true",
            f"serve.python={sys.executable}",
            f"serve.launch_cmd=[{Path(__file__).parent / 'sglang_double.py'}]",
            f"serve.model_path={tmp_path / 'model'}",
            f"serve.port={port}",
            "serve.max_servers=1",
            "serve.startup_timeout_s=120",
            f"serve.env={{SGLANG_DOUBLE_CONFIG: {REPO_ROOT / 'configs/tiny.yaml'}}}",
        ],
    )
    with pytest.raises(ValueError, match="would restart a server for every prompt: set bench.interleave: pass"):
        SGLangBackend(cfg, tmp_path)  # one server at a time, interleaved per prompt
    cfg.bench.interleave = "pass"
    backend = SGLangBackend(cfg, tmp_path)
    prompt = load_prompt_sets(cfg.target, cfg.bench, backend.tokenizer)[0].prompts[:1]
    (b,) = backend.run_baseline(prompt, 8)
    baseline = backend.launched["baseline"]
    (r,) = backend.run_speculative(prompt, Setting(3, 1, 4), 8)
    assert baseline.proc.poll() is not None and list(backend.launched) == [
        "3/1/4"
    ]  # max_servers 1: the baseline was stopped
    assert r.output_ids == b.output_ids and r.verify_count >= 1 and sum(r.accept_lengths) >= r.new_tokens - 1
    env = backend.environment()
    assert "--speculative-num-draft-tokens 4" in env["launched"]["3/1/4"] and env["servers"]["3/1/4"][
        "speculative_draft_model_path"
    ] == str(tmp_path / "export")
    server = backend.launched["3/1/4"]
    backend.close()
    assert server.proc.poll() is not None and not backend.launched
    assert sorted(p.name for p in (tmp_path / "serve").iterdir()) == [
        f"baseline-{port}.log",
        f"speculative-3-1-4-{port + 1}.log",
    ]


def test_the_bench_takes_its_http_timeout_from_its_own_section(tmp_path):
    """bench.sglang.timeout_s, not the harvest client's timeout (which the bench read before it had its own)."""
    sets = BENCH + ["bench.sglang.timeout_s=7", "harvest.sglang.timeout_s=99"]
    backend = SGLangBackend(load_config(REPO_ROOT / "configs/tiny.yaml", sets), tmp_path)
    assert backend.timeout_s == 7.0
    backend.close()
