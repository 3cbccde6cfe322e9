"""The protocol double against the wire facts recorded from a real SGLang 0.5.17 server.

tests/fixtures/sglang-0.5.17 holds what benchmarks/sglang_probe.py extracted from a real server
on an H200; the same probe is run here against the double (serving the tiny model), and every
recorded fact must agree, so a change to the double that drifts from the real server fails here.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests/fixtures/sglang-0.5.17"


def _probe():
    spec = importlib.util.spec_from_file_location("sglang_probe", ROOT / "benchmarks/sglang_probe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


probe = _probe()


@pytest.fixture(scope="module", params=["plain", "eagle3"])
def facts(request):
    real = json.loads((FIXTURES / f"facts-{request.param}.json").read_text())
    return request.param, real, probe.double_facts(request.param, 64)


def test_double_matches_recorded_real_server(facts):
    kind, real, double = facts
    assert probe.compare(real, double) == []


def test_avg_spec_accept_length_appears_once_a_speculative_request_is_verified(facts):
    """The real EAGLE3 server had no internal_states[0].avg_spec_accept_length before its first
    request (the fixture) and reported one after requests (a later H200 run, 1.69 with a trained
    drafter); SGLang's Scheduler.get_internal_state adds it only when cum_spec_accept_count > 0."""
    kind, real, double = facts
    assert real["internal_states_has_avg_spec_accept_length"] is False
    assert double["internal_states_has_avg_spec_accept_length_after_requests"] is (kind == "eagle3")


def test_compare_catches_drift(facts):
    kind, real, double = facts
    nested = dict(double, hidden_decode_entry_depths=[2])
    fewer_keys = dict(double, meta_keys=[k for k in double["meta_keys"] if k != "num_retractions"])
    assert [d.split(":")[0] for d in probe.compare(real, nested)] == ["hidden_decode_entry_depths"]
    assert [d.split(":")[0] for d in probe.compare(real, fewer_keys)] == ["meta_keys"]
    assert [
        d.split(":")[0] for d in probe.compare(real, {k: v for k, v in double.items() if k != "prefill_only_status"})
    ] == ["prefill_only_status"]


def test_finish_reason_keys_compare_as_a_shape():
    stop, length = {"finish_reason_keys": ["matched", "type"]}, {"finish_reason_keys": ["length", "type"]}
    assert probe.compare(stop, length) == []
    assert probe.compare(stop, {"finish_reason_keys": ["type"]}) != []
    assert probe.compare(stop, {"finish_reason_keys": ["length", "matched", "type"]}) != []
