"""The live bench's sglang backend with a DFlash drafter, end to end on loopback: the protocol double plays a DFLASH
server as SGLang 0.5.17 reports one (tests/sglang_double_rules.py dflash_server_args), given by URL or launched from
the exported drafter through the product's own DFLASH command; greedy and sampled."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import requests
import torch
from dflash_fixtures import random_dflash, tiny_dflash_config
from free_ports import free_ports
from sglang_double import DoubleEngine, SGLangDouble
from sglang_double_rules import dflash_server_args

from eagle3ft.config import REPO_ROOT, load_config
from eagle3ft.data.render import load_prompt_sets
from eagle3ft.drafter import dflash_export
from eagle3ft.eval.bench import schedule
from eagle3ft.eval.bench.sglang_backend import SGLangBackend
from eagle3ft.eval.decode.dflash_decode import DFlashDecoder
from eagle3ft.setting import Setting
from eagle3ft.targets.hf import load_target
from eagle3ft.targets.sglang_http import SGLangError

BENCH = [
    "bench.backend=sglang",
    "bench.prompts={kind: mtbench, limit: 2}",
    "bench.max_new_tokens=12",
    "bench.repetitions=2",
    "bench.settings=[{steps: 3, topk: 1, num_draft_tokens: 4}]",  # the drafter's block B = 4
]
DOUBLE = Path(__file__).parent / "sglang_double.py"


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(REPO_ROOT / "configs/tiny.yaml")
    model, tok = load_target(cfg.target)
    drafter = random_dflash(tiny_dflash_config(block_size=4), seed=3).to(next(model.parameters()).dtype).eval()
    return cfg, model, tok, drafter


def spec_double(model, tok, drafter, version="0.5.17") -> SGLangDouble:
    engine = DoubleEngine(model, tok, drafter=drafter, spec_num_draft_tokens=drafter.config.block_size)
    return SGLangDouble(engine, version=version).start()


def test_dflash_double_answers_as_a_dflash_server(tiny):
    _, model, tok, drafter = tiny
    with spec_double(model, tok, drafter) as spec:
        info = requests.get(spec.url + "/server_info", timeout=30).json()
        assert (info["speculative_algorithm"], info["speculative_num_steps"], info["speculative_eagle_topk"]) == (
            "DFLASH",
            1,
            1,
        )
        assert info["speculative_num_draft_tokens"] == 4 and info["max_running_requests"] == 48
        r = requests.post(spec.url + "/generate", json={"input_ids": [100, 200], "return_logprob": True}, timeout=60)
        assert r.status_code == 400 and "DFLASH speculative decoding does not support return_logprob" in r.text
        body = requests.post(
            spec.url + "/generate",
            json={"input_ids": [100, 200, 300], "sampling_params": {"max_new_tokens": 10, "temperature": 0}},
            timeout=60,
        ).json()
        meta = body["meta_info"]
        g = DFlashDecoder(model, drafter).generate([100, 200, 300], 10)
        assert body["output_ids"] == g.tokens and meta["spec_verify_ct"] == g.verify_count
        assert meta["spec_num_proposed_drafts"] == g.verify_count * 3  # verify_ct x (B - 1)
        assert meta["spec_accept_length"] == pytest.approx(len(g.tokens) / g.verify_count)
        hist = meta["spec_correct_drafts_histogram"]  # cycles by drafts accepted, as the scheduler counts
        assert sum(hist) == g.verify_count and sum(i * n for i, n in enumerate(hist)) == meta["spec_num_correct_drafts"]


def test_bench_through_a_dflash_double(tiny, tmp_path):
    _, model, tok, drafter = tiny
    base = SGLangDouble(DoubleEngine(model, tok), version="0.5.17").start()
    spec = spec_double(model, tok, drafter)
    try:
        sets = [f"bench.sglang.baseline_url={base.url}", f"bench.sglang.speculative_url={spec.url}"]
        cfg = load_config(REPO_ROOT / "configs/tiny.yaml", BENCH + sets)
        backend = SGLangBackend(cfg, tmp_path)
        with pytest.raises(SGLangError, match=f"{spec.url} serves DFLASH 1/1/4"):
            backend.url(Setting(2, 1, 3))
        sets_ = load_prompt_sets(cfg.target, cfg.bench, backend.tokenizer)
        summary = schedule.run(cfg.eval, cfg.bench, tmp_path, backend, sets_, log=lambda *_: None)
        backend.close()
    finally:
        base.stop()
        spec.stop()
    dec = DFlashDecoder(model, drafter, backend.eos_ids)
    gens = [dec.generate(p, cfg.bench.max_new_tokens) for p in sets_[0].prompts]
    (row,) = summary["speculative"]
    assert row["setting"] == {"steps": 3, "topk": 1, "num_draft_tokens": 4} and row["outputs_match_baseline"] == 1.0
    assert row["verify_count"] == cfg.bench.repetitions * sum(g.verify_count for g in gens)
    assert row["tau"] == pytest.approx(sum(sum(g.accept_lengths) for g in gens) / sum(g.verify_count for g in gens))
    env = summary["environment"]
    assert env["servers"]["3/1/4"]["speculative_algorithm"] == "DFLASH"
    assert env["sglang_tau"]["3/1/4"]["server_avg_spec_accept_length"][-1] == pytest.approx(
        spec.engine.spec_tokens / spec.engine.spec_verifies
    )
    assert env["speculative_sampling"] == {}  # greedy


@pytest.mark.slow
def test_sampled_bench_launches_a_dflash_server_and_records_its_verify(tiny, tmp_path):
    """bench.sglang.launch with a DFlash drafter in eval.checkpoint: the product's DFLASH command starts the double,
    which runs the block decoder with SGLang's sampled verify; the summary keeps the rule and thresholds it reported and
    that its log shows no greedy fallback."""
    _, model, tok, drafter = tiny
    dflash_export.save(drafter.float(), tmp_path / "export")
    port = free_ports(2)
    cfg = load_config(
        REPO_ROOT / "configs/tiny.yaml",
        BENCH
        + [
            "bench.temperature=0.7",
            "bench.repetitions=1",
            "bench.interleave=pass",
            "bench.sglang.launch=true",
            f"eval.checkpoint={tmp_path / 'export'}",
            f"serve.python={sys.executable}",
            f"serve.launch_cmd=[{DOUBLE}]",
            f"serve.model_path={tmp_path / 'model'}",
            f"serve.port={port}",
            "serve.max_servers=1",
            "serve.startup_timeout_s=120",
            f"serve.env={{SGLANG_DOUBLE_CONFIG: {REPO_ROOT / 'configs/tiny.yaml'}}}",
        ],
    )
    backend = SGLangBackend(cfg, tmp_path)
    summary = schedule.run(
        cfg.eval,
        cfg.bench,
        tmp_path,
        backend,
        load_prompt_sets(cfg.target, cfg.bench, backend.tokenizer),
        log=lambda *_: None,
    )
    env = backend.environment()
    backend.close()
    assert "--speculative-algorithm DFLASH" in env["launched"]["3/1/4"]
    assert "--attention-backend triton" in env["launched"]["3/1/4"]
    assert env["servers"]["3/1/4"]["speculative_num_draft_tokens"] == 4
    assert summary["temperature"] == 0.7
    assert summary["environment"]["speculative_sampling"] == {
        "3/1/4": {
            "verify": "target_only",
            "speculative_accept_threshold_single": 1.0,
            "speculative_accept_threshold_acc": 1.0,
            "greedy_fallback": False,
        }
    }
    (row,) = summary["speculative"]
    assert row["verify_count"] > 0 and row["tau"] >= 1.0
    requests_log = [json.loads(x) for x in (tmp_path / "bench/sglang_requests.jsonl").read_text().splitlines()]
    assert all(
        r["spec_num_proposed_drafts"] == 3 * r["spec_verify_ct"] for r in requests_log if r["setting"] != "baseline"
    )


def test_dflash_launch_resolves_as_0_5_17s_hook():
    """The double's DFLASH launch (tests/sglang_double_rules.py) as 0.5.17's _handle_dflash resolves it."""
    args = argparse.Namespace(
        speculative_num_draft_tokens=8,
        speculative_dflash_block_size=16,
        speculative_draft_attention_backend=None,
        attention_backend="triton",
        max_running_requests=None,
        speculative_accept_threshold_single=1.0,
        speculative_accept_threshold_acc=0.5,
    )
    with pytest.raises(ValueError, match="For DFLASH they must match"):
        dflash_server_args(args, 16)
    args.speculative_num_draft_tokens = None
    got = dflash_server_args(args, 4)  # the alias wins over the drafter's block
    assert got["speculative_num_draft_tokens"] == 16 and got["speculative_draft_attention_backend"] == "triton"
    assert (got["speculative_num_steps"], got["speculative_eagle_topk"], got["max_running_requests"]) == (1, 1, 48)
    assert got["speculative_accept_threshold_acc"] == 0.5
    args.speculative_dflash_block_size = None
    for target, draft in (
        (None, "flashinfer"),
        ("fa3", "fa3"),
        ("torch_native", "flashinfer"),
        ("trtllm_mha", "flashinfer"),
    ):
        args.attention_backend = target
        assert dflash_server_args(args, 4)["speculative_draft_attention_backend"] == draft, target
    assert dflash_server_args(args, 4)["speculative_num_draft_tokens"] == 4  # neither flag: the drafter's block_size


@pytest.mark.slow
def test_plain_eagle3_and_dflash_servers_benched_together(tiny, tmp_path, capsys, monkeypatch):
    """The lease plan's bench (benchmarks/leases/dflash_vs_eagle3_live.sh): `eagle3ft bench` with a plain server, an EAGLE3 one
    and a DFLASH one given by URL, both settings interleaved per prompt, the DFlash export as eval.checkpoint; the
    summary prices each setting by its own measured cycle."""
    from eagle3ft.commands import main
    from eagle3ft.drafter.config import DrafterConfig
    from eagle3ft.drafter.model import Eagle3Drafter

    _, model, tok, _ = tiny
    dflash = random_dflash(tiny_dflash_config(block_size=5), seed=3).to(next(model.parameters()).dtype).eval()
    dflash_export.save(dflash.float(), tmp_path / "dflash")
    torch.manual_seed(0)
    eagle = Eagle3Drafter(DrafterConfig.from_json(REPO_ROOT / "configs/drafters/tiny.json")).eval()
    with torch.no_grad():
        eagle.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
    base = SGLangDouble(DoubleEngine(model, tok), version="0.5.17").start()
    e3 = SGLangDouble(DoubleEngine(model, tok, drafter=eagle, spec_steps=3, spec_num_draft_tokens=4)).start()
    df = spec_double(model, tok, dflash)
    monkeypatch.setattr(sys, "argv", ["eagle3ft"])
    run = tmp_path / "run"
    run.mkdir()
    sets = [
        "bench.backend=sglang",
        "bench.prompts={kind: mtbench, limit: 2}",
        "bench.max_new_tokens=10",
        "bench.repetitions=2",
        "bench.interleave=prompt",
        "bench.temperature=0.7",
        "bench.settings=[{steps: 3, topk: 1, num_draft_tokens: 4}, {steps: 4, topk: 1, num_draft_tokens: 5}]",
        f"bench.sglang.baseline_url={base.url}",
        f"bench.sglang.speculative_urls=[{e3.url}, {df.url}]",
        "bench.sglang.same_prompts=false",
        f"eval.checkpoint={tmp_path / 'dflash'}",
        f"drafter.config={tmp_path / 'dflash' / 'config.json'}",
    ]
    try:
        with pytest.raises(SystemExit) as e:
            main(
                ["bench", "--config", str(REPO_ROOT / "configs/tiny.yaml"), "--run-dir", str(run)]
                + sum((["--set", x] for x in sets), [])
            )
    finally:
        for d in (base, e3, df):
            d.stop()
    assert e.value.code in (0, None), capsys.readouterr().err[-3000:]
    summary = json.loads((run / "bench/summary.json").read_text())
    rows = {r["key"]: r for r in summary["speculative"]}
    assert set(rows) == {"3/1/4", "4/1/5"} and all(
        r["verify_count"] > 0 and r["cycle_plain_steps"] for r in rows.values()
    )
    env = summary["environment"]
    assert env["servers"]["3/1/4"]["speculative_algorithm"] == "EAGLE3"
    assert env["servers"]["4/1/5"]["speculative_algorithm"] == "DFLASH"
    assert env["speculative_sampling"]["4/1/5"]["verify"] == "target_only"
    assert env["speculative_sampling"]["3/1/4"]["speculative_use_rejection_sampling"] is False
    assert set(summary["costs"]["verify_s"]) == {"4", "5"}  # each setting's own cycle
    assert (run / "bench/economics.json").is_file()
