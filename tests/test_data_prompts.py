"""Prompt sources: the truncated ShareGPT stream, MT-Bench, local files, normalization and bad input."""

import io
import json
from collections import Counter

import pytest

from eagle3ft.config import REPO_ROOT, SourceConfig
from eagle3ft.data.prompts import Skip, collect, content_key, normalize, sharegpt_path, split_of
from eagle3ft.data.readers import iter_json_items


def sharegpt_record(i, turns=1):
    conv = []
    for t in range(turns):
        conv += [{"from": "human", "value": f"question {i}.{t}"}, {"from": "gpt", "value": f"answer {i}.{t}"}]
    return {"id": str(i), "conversations": conv}


def bad_corpus_lines() -> list[bytes]:
    """Two good records among one of each kind of bad input."""
    good_a = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}
    good_b = sharegpt_record(7, turns=2)
    return [
        json.dumps(good_a).encode(),
        b'{"conversations": [{"from": "human", "value": "unterminated',  # malformed
        b"[1, 2, 3]",  # valid JSON, not a record: malformed
        json.dumps({"conversations": []}).encode(),  # empty
        json.dumps({"messages": [{"role": "user", "content": "   "}]}).encode(),  # empty content
        json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(),  # unknown role
        b'{"messages": [{"role": "user", "content": "caf\xe9 \xff\xfe"}]}',  # invalid UTF-8 bytes
        b"",  # blank line: counted
        json.dumps(good_b).encode(),
        json.dumps(good_a).encode(),  # duplicate
    ]


def test_truncated_array_is_streamed_item_by_item():
    items = [sharegpt_record(i) for i in range(3)]
    text = json.dumps(items, indent=2)
    cut = text[: text.rindex("}") - 3]  # the third record loses its end
    skips = Counter()
    got = list(iter_json_items(io.BytesIO(cut.encode()), skips, chunk_bytes=7))
    assert got == items[:2] and skips == {"truncated_tail": 1}
    assert list(iter_json_items(io.BytesIO(text.encode()), Counter(), chunk_bytes=5)) == items
    assert list(iter_json_items(io.BytesIO(b"[]"), Counter())) == []


def test_sharegpt_small_limit_reads_only_the_head():
    path = sharegpt_path()
    assert path.stat().st_size > 100e6
    with open(path, "rb") as f:
        it = iter_json_items(f, Counter())
        first = [next(it) for _ in range(5)]
        assert f.tell() <= 2 << 20
    assert all("conversations" in r for r in first)


def test_normalize_roles_and_turns():
    rec = {
        "conversations": [
            {"from": "gpt", "value": "Hi!"},
            {"from": "human", "value": "a"},
            {"from": "gpt", "value": "b"},
            {"from": "human", "value": "c"},
            {"from": "gpt", "value": "d"},
            {"from": "human", "value": "e"},
        ]
    }
    assert normalize(rec, 2, regenerate=False) == [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    assert normalize(rec, 2, regenerate=True) == [{"role": "user", "content": "a"}, {"role": "user", "content": "c"}]
    sys_rec = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]}
    assert normalize(sys_rec, 1, True)[0] == {"role": "system", "content": "be brief"}
    with pytest.raises(Skip, match="empty"):
        normalize(sys_rec, 1, regenerate=False)  # no answer to train on
    with pytest.raises(Skip, match="bad_turn_order"):
        normalize({"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}, 2, False)


def test_bad_input_is_skipped_and_counted(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(bad_corpus_lines()) + b"\n")
    skips = Counter()
    convs = collect(
        [SourceConfig(kind="file", path=str(path))],
        max_turns=2,
        regenerate=True,
        heldout_fraction=0.0,
        dedupe=True,
        skips=skips,
    )
    assert [c.messages[0]["content"] for c in convs] == ["Name a colour.", "question 7.0"]
    assert len(convs[1].messages) == 2 and convs[0].source == f"file:{path}"
    assert skips == {"malformed": 2, "empty": 2, "unknown_role": 1, "invalid_utf8": 1, "blank_line": 1, "duplicate": 1}


def test_split_is_a_fixed_function_of_content_and_sources_can_force_it(tmp_path):
    msgs = [[{"role": "user", "content": f"q{i}"}] for i in range(2000)]
    splits = [split_of(content_key(m, True), 0.1) for m in msgs]
    assert splits == [split_of(content_key(m, True), 0.1) for m in msgs]
    assert 0.07 < splits.count("heldout") / len(splits) < 0.13
    assert content_key([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], True) == content_key(
        [{"role": "user", "content": "q"}], True
    )
    mt = collect(
        [SourceConfig(kind="mtbench", split="heldout")],
        max_turns=2,
        regenerate=True,
        heldout_fraction=0.0,
        dedupe=True,
        skips=Counter(),
    )
    assert len(mt) == 80 and {c.split for c in mt} == {"heldout"} and all(len(c.messages) == 2 for c in mt)
    sg = collect(
        [SourceConfig(kind="sharegpt", limit=6)],
        max_turns=1,
        regenerate=True,
        heldout_fraction=0.5,
        dedupe=True,
        skips=Counter(),
    )
    assert len(sg) == 6 and [c.split for c in sg] == [split_of(c.key, 0.5) for c in sg]


def test_json_and_parquet_files(tmp_path):
    import datasets

    records = [sharegpt_record(i) for i in range(4)]
    (tmp_path / "a.json").write_text(json.dumps(records))
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "a.parquet"))
    for name in ("a.json", "a.parquet"):
        convs = collect(
            [SourceConfig(kind="file", path=str(tmp_path / name), limit=3)],
            max_turns=1,
            regenerate=False,
            heldout_fraction=0.0,
            dedupe=True,
            skips=Counter(),
        )
        assert [c.messages[1]["content"] for c in convs] == ["answer 0.0", "answer 1.0", "answer 2.0"]
    with pytest.raises(FileNotFoundError, match="not found"):
        collect(
            [SourceConfig(kind="file", path=str(tmp_path / "missing.jsonl"))],
            max_turns=1,
            regenerate=True,
            heldout_fraction=0.0,
            dedupe=True,
            skips=Counter(),
        )


def test_a_replay_source_with_exclude_heldout_drops_what_shares_an_8gram_with_a_heldout_set(tmp_path):
    from eagle3ft.data.contamination import heldout_filter
    from eagle3ft.data.prompts import iter_records, raw_messages

    question = raw_messages(next(iter_records(SourceConfig(kind="mtbench"), Counter())))[0][1]
    everyday = json.loads((REPO_ROOT / "data/sets/everyday-v1.jsonl").read_text().splitlines()[3])
    planted = [
        f"Before anything else: {' '.join(question.split()[:9])}",  # the first 9 words of MT-Bench's first question
        everyday["messages"][0]["content"].upper(),  # an everyday prompt (words are matched lowercased)
        "Give three tips for keeping basil alive on a windowsill.",
        "What is the capital of Australia, and why is it not Sydney?",
    ]
    train = tmp_path / "general.jsonl"
    train.write_text("".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in planted))
    heldout = SourceConfig(kind="mtbench", limit=1, split="heldout")

    def kept(exclude: bool, extra=()) -> tuple[list[str], Counter]:
        skips = Counter()
        src = SourceConfig(kind="file", path=str(train), split="train", exclude_heldout=exclude, limit=3)
        convs = collect(
            [heldout, src],
            max_turns=1,
            regenerate=True,
            heldout_fraction=0.0,
            dedupe=True,
            skips=skips,
            heldout=heldout_filter([heldout, src], extra),
        )
        return [c.messages[0]["content"] for c in convs if c.split == "train"], skips

    assert kept(False) == (planted[:3], Counter())  # without the flag the planted prompts are trained on
    got, skips = kept(True)  # against the harvest's held-out source
    assert got == planted[1:4] and skips == Counter(heldout_ngram=1)  # the limit applies after the drop
    everyday_set = [SourceConfig(kind="file", path="data/sets/everyday-v1.jsonl")]
    assert kept(True, everyday_set) == (planted[2:4], Counter(heldout_ngram=2))


def test_source_identity_keeps_earlier_fingerprints_and_ignores_the_training_weight():
    from eagle3ft.data.prompts import source_identity

    plain = source_identity([SourceConfig(kind="sharegpt", limit=4)])
    assert "weight" not in plain[0] and "exclude_heldout" not in plain[0]
    assert source_identity([SourceConfig(kind="sharegpt", limit=4, weight=0.25, name="general")]) == plain
    assert source_identity([SourceConfig(kind="sharegpt", limit=4, exclude_heldout=True)]) != plain


def test_exclude_heldout_without_heldout_sets_to_check_is_refused():
    src = SourceConfig(kind="mtbench", exclude_heldout=True)
    with pytest.raises(ValueError, match="no held-out sets were given to check it against"):
        collect([src], max_turns=1, regenerate=True, heldout_fraction=0.0, dedupe=True, skips=Counter())
