"""benchmarks/vocab_coverage.py on hand-made answers whose coverage, unreachable share and τ ceilings are counted
by hand."""

from __future__ import annotations

import gzip
import importlib.util
import json

import torch

from eagle3ft.config import REPO_ROOT
from eagle3ft.data.loops import loop_mask

spec = importlib.util.spec_from_file_location("vocab_coverage", REPO_ROOT / "benchmarks" / "vocab_coverage.py")
vc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vc)


def vocab(*ids: int, size: int = 16) -> torch.Tensor:
    t = torch.zeros(size, dtype=torch.bool)
    t[list(ids)] = True
    return t


def test_a_hand_made_answer():
    # y = 5 1 2 9 3 with {1, 2, 3} in the vocabulary: 3 of 5 tokens covered. Roots 0..3 (y0 comes from the prefill)
    # draft y1..y4 = 1 2 9 3: one of four next tokens (9) unreachable.
    # Chain at depth 3: depth 1 accepted at roots 0, 1, 3 of 4 -> a1 = 3/4; depth 2 exists at roots 0-2, reached at
    # 0, 1, accepted at 0 (y2) not 1 (y3 = 9) -> a2 = 1/2; depth 3 exists at roots 0-1, reached at 0, y3 = 9 -> a3 = 0.
    # tau = 1 + 3/4 + 3/8 = 2.125. The walk: root 0 accepts y1 y2 and gets y3 from the target (3 tokens), root 3
    # accepts y4, the answer's end (1 token): 4 tokens in 2 verifies, 2.0.
    r = vc.coverage([[5, 1, 2, 9, 3]], vocab(1, 2, 3))
    assert (r["tokens"], r["coverage"], r["roots"], r["unreachable"]) == (5, 0.6, 4, 0.25)
    assert r["tau_ceiling_3_1_4"] == 2.125 and r["tau_walk_ceiling_3_1_4"] == 2.0
    assert r["loop_share"] == 0 and r["coverage_loop_free"] == 0.6 and r["tau_ceiling_3_1_4_loop_free"] == 2.125


def test_full_coverage_reaches_the_chain_cap_and_loops_are_counted_apart():
    assert vc.coverage([[1, 2, 3, 1, 2]], vocab(1, 2, 3))["tau_ceiling_3_1_4"] == 4.0
    looped = [7, 8] + [1, 2, 9] * 10  # copies itself: its tail is a loop (data/loops.py)
    loops = loop_mask(looped)
    assert 0 < sum(loops) < len(looped)
    r = vc.coverage([looped], vocab(1, 2, 7, 8))
    free = [t for t, lp in zip(looped, loops) if not lp]
    assert r["coverage_loop_free"] == round(sum(t != 9 for t in free) / len(free), 4)
    assert r["loop_share"] == round(sum(loops) / len(looped), 4) and r["coverage"] == round(
        22 / 32, 4
    )  # 7, 8 and ten times 1, 2


def test_answers_are_read_once_per_prompt_from_the_first_plain_repetition(tmp_path):
    rows = [
        {"mode": "baseline", "repetition": 1, "prompt_index": 0, "output_ids": [9]},
        {"mode": "speculative", "repetition": 0, "prompt_index": 0, "output_ids": [8]},
        {"mode": "baseline", "repetition": 0, "prompt_index": 1, "output_ids": [2, 3]},
        {"mode": "baseline", "repetition": 0, "prompt_index": 0, "output_ids": [1]},
    ]
    path = tmp_path / "runs.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    assert vc.read_answers(path) == [[1], [2, 3]]
