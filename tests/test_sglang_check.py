"""`eagle3ft sglang-check` against the protocol double playing each version, and the meta_info keys each version
sends (0.5.23 dropped three), read by the bench and the probe."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import requests
import torch

from eagle3ft.config import REPO_ROOT, load_config
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.eval.bench.sglang_requests import accept_lengths_from
from eagle3ft.targets import sglang_check
from eagle3ft.targets.hf import load_target
from eagle3ft.targets.sglang_versions import SPEC_META_KEYS, SPEC_META_KEYS_REMOVED

sys.path.insert(0, str(Path(__file__).parent))
from sglang_double import DoubleEngine, SGLangDouble  # noqa: E402

_spec = importlib.util.spec_from_file_location("sglang_probe", REPO_ROOT / "benchmarks/sglang_probe.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(REPO_ROOT / "configs/tiny.yaml")
    model, tok = load_target(cfg.target)
    torch.manual_seed(0)
    d = Eagle3Drafter(DrafterConfig.from_json(REPO_ROOT / cfg.drafter.config))
    d.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    return model, tok, d.eval()


def _spec_meta(url: str) -> dict:
    body = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}}
    return requests.post(url + "/generate", json=body, timeout=60).json()["meta_info"]


@pytest.mark.parametrize("version", ["0.5.17", "0.5.23"])
def test_each_double_sends_its_versions_spec_keys_and_the_bench_reads_both(tiny, version):
    model, tok, drafter = tiny
    with SGLangDouble(DoubleEngine(model, tok, drafter=drafter), version=version) as d:
        meta = _spec_meta(d.url)
    keys = {k for k in meta if k.startswith("spec_")}
    removed = set(SPEC_META_KEYS_REMOVED)
    assert set(SPEC_META_KEYS) <= keys and (keys & removed == (removed if version == "0.5.17" else set()))
    lens = accept_lengths_from(meta, meta["completion_tokens"])
    hist = meta["spec_correct_drafts_histogram"]
    assert lens == [k + 1 for k, n in enumerate(hist) for _ in range(n)] and len(lens) == meta["spec_verify_ct"]


def test_the_probe_reads_0_5_23s_histogram():
    facts = probe.double_facts("eagle3", 64, "0.5.23")
    assert not set(facts["spec_keys"]) & set(SPEC_META_KEYS_REMOVED)
    assert facts["spec_histogram_sum_minus_verify_ct"] == 0


def test_check_an_aux_capture_server(tiny):
    model, tok, _ = tiny
    with SGLangDouble(DoubleEngine(model, tok, aux_layer_ids=[0, 1, 2]), version="0.5.23") as d:
        lines, ok = sglang_check.report(d.url)
    assert ok and len(lines) == 3
    assert lines[0].startswith("SGLang 0.5.23 at ") and "supported (checked by its rules)" in lines[0]
    assert lines[1] == "aux capture: layers [0, 1, 2] without a draft model"
    width = 3 * model.config.hidden_size
    assert lines[2] == f"hidden states: returned, 3 rows of width {width} (the aux layers concatenated)"


def test_check_an_eagle3_server_and_a_plain_one(tiny, tmp_path):
    model, tok, drafter = tiny
    from eagle3ft.drafter.export import export_drafter

    export_drafter(drafter, tmp_path / "draft")
    with SGLangDouble(
        DoubleEngine(model, tok, drafter=drafter),
        version="0.5.17",
        server_args={"speculative_draft_model_path": str(tmp_path / "draft")},
    ) as d:
        lines, ok = sglang_check.report(d.url)
    assert ok and "supported (checked live on a GPU)" in lines[0]
    assert lines[1].startswith(f"aux capture: the EAGLE3 draft's layers {list(drafter.config.aux_layer_ids)}")
    assert lines[3].startswith("speculative: EAGLE3, max_running_requests 48; sampled verification: ")
    assert "accept_threshold_single 1.0" in lines[3]
    with SGLangDouble(
        DoubleEngine(model, tok), version="0.5.17", server_args={"enable_return_hidden_states": False}
    ) as d:
        lines, ok = sglang_check.report(d.url)
    assert not ok and lines[1].startswith("aux capture: none") and lines[2].startswith("hidden states: not returned")


def test_check_an_unsupported_version_says_so_and_fails(tiny, capsys):
    model, tok, _ = tiny
    with SGLangDouble(DoubleEngine(model, tok, aux_layer_ids=[0, 1, 2]), version="0.5.23") as d:
        d.version = "0.6.1"
        code = sglang_check.main(["--url", d.url])
    out = capsys.readouterr().out
    assert code == 1 and "SGLang 0.6.1" in out and "NOT supported (supported: 0.5.17, 0.5.23)" in out
    assert sglang_check.main(["--url", "http://127.0.0.1:9"]) == 1
