"""benchmarks/data_loops.py: the loop share of a token store's answers, per source, on a store written here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from eagle3ft.data.tokens import TokenSample, TokenWriter

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("data_loops", ROOT / "benchmarks" / "data_loops.py")
data_loops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(data_loops)

LOOP = list(range(10)) * 4  # 40 tokens: the first 10 + 7 are not repeated, the 23 after them are a loop
PLAIN = list(range(100, 140))  # 40 distinct tokens


def conv(i: int, answer: list[int], source: str) -> TokenSample:
    prompt = [900, 901, 902]
    ids = prompt + answer + [903] + answer[:5]  # a second turn: 5 answer tokens after one prompt token
    mask = [0] * 3 + [1] * len(answer) + [0] + [1] * 5
    return TokenSample(sample_id=i, input_ids=ids, loss_mask=mask, source=source)


def test_answers_split_on_the_mask():
    assert data_loops.answers([1, 2, 3, 4, 5, 6], [0, 1, 1, 0, 1, 1]) == [[2, 3], [5, 6]]
    assert data_loops.answers([1, 2], [1, 1]) == [[1, 2]]


def test_loop_share_per_source(tmp_path):
    w = TokenWriter(tmp_path / "tokens", {"target": "t", "tokenizer": "tok", "chat_template": "auto"}, "fp")
    w.commit("train", 0, [conv(0, LOOP, "t0"), conv(1, PLAIN, "t0"), conv(2, PLAIN, "magpie")])
    w.finish()
    out = tmp_path / "loops.json"
    lines = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "data_loops.py"), str(tmp_path / "tokens"), "--out", str(out)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    rows = {r["source"]: r for r in map(json.loads, lines)}
    assert rows["t0"]["answers"] == 4 and rows["t0"]["tokens"] == 90
    assert rows["t0"]["loop_tokens"] == 23 and rows["t0"]["answers_with_loop"] == 1
    assert rows["t0"]["loop_share"] == round(23 / 90, 4)
    assert rows["magpie"]["loop_tokens"] == 0 and rows["magpie"]["answers_with_loop_share"] == 0.0
    assert json.loads(out.read_text())[str(tmp_path / "tokens")]["magpie"]["tokens"] == 45
    assert "unfinished_answers" not in rows["t0"]  # two sources: the manifest does not split the count
