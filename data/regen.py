"""Regeneration: prompts -> the target writes every assistant turn -> the token store ``RUN/tokens/``.

    python data/regen.py --config CFG --run-dir RUN

The conversations (``harvest.sources``) are put in a fixed order (most user turns first) and cut into
chunks of ``harvest.shard_samples`` per split; a chunk is committed whole as one
shard of data/tokens.py once all its conversations are done. Rerunning the same
command skips the committed chunks, so a killed run resumes, losing and
duplicating nothing.

Scheduling: a conversation's turns depend on one another, so its remaining user turns are a chain that no
number of servers shortens. With ``harvest.sglang.priority`` (the default) each ready turn carries a
priority, the user turns its conversation still has to answer (this one included), and is sent highest
first (`ReadyTurns`), also to the server (SGLang's ``priority`` field, honoured by a server started with
``--enable-priority-scheduling``): long chains start at once and never wait behind single turns, which
fill the servers around them. Without it, turns go first come first served. A conversation stays on one
server, whose prefix cache then holds the prompt of its next turn.

Each assistant turn is generated in order: turn k's prompt is turn k-1's prompt,
the target's own answer ids (end-of-turn token included), then the template's
ids for the next user turn (``ChatFormat.next_turn_ids``); no text round trip.
An answer cut by ``max_new_tokens`` / ``max_total_tokens`` ends its conversation
there (it is kept, counted as unfinished). Loss mask: 1 on generated ids.

Backends (``harvest.backend``, data/regen_backends.py):

- ``sglang``: plain SGLang servers at ``harvest.sglang.urls`` (no hidden states needed;
  ``--skip-tokenizer-init`` works too). ``concurrency`` requests in flight per server,
  each a ``/generate`` call with ``prompts_per_request`` prompts as a list of
  ``input_ids``. Conversations move independently: a finished turn queues the next.
  Failed calls are retried with backoff (``retries``, ``backoff_s``); then the run
  stops with one line naming the server, keeping every committed chunk.
- ``hf``: the embedded transformers target (eagle3ft/targets/hf.py) in batches of
  ``harvest.batch_size``, for CPUs and tests.

A summary (answer tokens, wall time, answer tokens/s, per-split counts) goes to
stdout and ``RUN/tokens/summary.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads slow a busy CPU; before torch loads

import hashlib
import itertools
import json
import queue
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from eagle3ft.cli import cli_errors, error_log, parse_cli, save_resolved
from eagle3ft.config import Config, to_dict
from eagle3ft.data.chat import ChatFormat
from eagle3ft.data.harvest import check_harvest_config, request_seed, sample_id
from eagle3ft.data.prompts import Conversation, check_source, collect, source_identity
from eagle3ft.data.regen_backends import Answer, Gen, RegenError, open_backend
from eagle3ft.data.store import SPLITS, StoreError
from eagle3ft.data.tokens import TokenSample, TokenWriter, tokenizer_digest
from eagle3ft.files import write_atomic
from eagle3ft.run_dir import RunDir
from eagle3ft.runlock import holding
from eagle3ft.targets.base import Sampling
from eagle3ft.targets.hf import load_tokenizer

# --------------------------------------------------------------------------- conversations in flight


@dataclass
class ConvState:
    """One conversation being regenerated; only the main thread touches it."""

    conv: Conversation
    chunk: tuple[str, int]
    head: list[dict]  # system message, if any
    users: list[dict]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn: int = 0  # assistant turns written
    unfinished: int = 0
    answers: list[str] = field(default_factory=list)  # decoded answers: the history the template renders
    sample: TokenSample | None = None
    server: int = 0  # every turn goes to this server (its prefix cache holds the conversation so far)


@dataclass
class RunStats:
    answer_tokens: int = 0
    answers: int = 0
    unfinished: int = 0


class ReadyTurns:
    """The turns ready to generate on one server: highest priority first, first come first served among equal
    priorities. Thread-safe (the main thread puts, the server's workers take)."""

    def __init__(self) -> None:
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()

    def put(self, s: ConvState, g: Gen) -> None:
        self._q.put((-g.priority, next(self._seq), (s, g)))

    def get(self, timeout: float) -> tuple[ConvState, Gen]:
        return self._q.get(timeout=timeout)[2]

    def get_nowait(self) -> tuple[ConvState, Gen]:
        return self._q.get_nowait()[2]


class Regenerator:
    """Moves conversations turn by turn through the backend's workers; commits chunks as they complete."""

    def __init__(self, cfg: Config, chat: ChatFormat, backend, writer: TokenWriter, bar: tqdm):
        self.h, self.seed, self.chat, self.backend, self.writer, self.bar = (
            cfg.harvest,
            cfg.seed,
            chat,
            backend,
            writer,
            bar,
        )
        self.ready = [ReadyTurns() for _ in range(backend.servers)]
        self.opened = 0  # conversations opened so far: the next one's server is opened % servers
        self.results: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.stats = RunStats()
        self.left: dict[tuple[str, int], int] = {}  # conversations of an open chunk not done yet
        self.t0 = time.time()

    # ------------------------------------------------------------------ turns

    def _messages(self, s: ConvState, upto_user: int) -> list[dict]:
        msgs = list(s.head)
        for k in range(upto_user + 1):
            msgs.append(s.users[k])
            if k < upto_user:
                msgs.append({"role": "assistant", "content": s.answers[k]})
        return msgs

    def _next(self, s: ConvState, chunk_skips: Counter) -> Gen | None:
        """The next turn of `s`, or None when the conversation is over."""
        if s.turn >= len(s.users) or (s.turn and s.unfinished):
            return None
        if s.turn == 0:
            ids, _ = self.chat.encode(self._messages(s, 0), add_generation_prompt=True)
        else:
            ids = self.chat.next_turn_ids(self._messages(s, s.turn))
        prompt = s.ids + ids
        budget = min(self.h.max_new_tokens, self.h.max_total_tokens - len(prompt))
        if budget <= 0:
            if s.turn == 0:
                chunk_skips["too_long"] += 1
            else:
                chunk_skips["turns_cut_by_max_total_tokens"] += len(s.users) - s.turn
            return None
        s.ids, s.mask = prompt, s.mask + [0] * len(ids)
        priority = len(s.users) - s.turn if self.h.sglang.priority else 0
        return Gen(prompt, budget, request_seed(self.seed, s.conv.key, s.turn), priority=priority)

    def _take(self, s: ConvState, a: Answer) -> None:
        s.ids = s.ids + a.ids
        s.mask = s.mask + [1] * len(a.ids)
        s.turn += 1
        s.unfinished += not a.finished
        s.answers.append(self.chat.decode(a.ids))
        self.stats.answer_tokens += len(a.ids)
        self.stats.answers += 1
        self.stats.unfinished += not a.finished

    # ------------------------------------------------------------------ workers

    def _worker(self, slot: int) -> None:
        ready = self.ready[self.backend.slot_server[slot]]
        while not self.stop.is_set():
            try:
                first = ready.get(timeout=0.5)  # idle workers wake rarely: thousands may wait at once
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < self.backend.batch:
                try:
                    batch.append(ready.get_nowait())
                except queue.Empty:
                    break
            try:
                answers = self.backend.generate(slot, [g for _, g in batch])
            except Exception as e:  # noqa: BLE001 - reported by the main thread with its server
                self.results.put(("error", f"{self.backend.slots[slot]}: {e}"))
                return
            self.results.put(("ok", [(s, a) for (s, _), a in zip(batch, answers)]))

    # ------------------------------------------------------------------ the run

    def run(self, todo: list[tuple[str, int, list[Conversation]]]) -> None:
        """Regenerate every chunk of `todo`; chunks are opened while fewer than a window of conversations is open."""
        capacity = len(self.backend.slots) * self.backend.batch
        window = max(4 * capacity, 1)
        pending = list(reversed(todo))
        open_chunks: dict[tuple[str, int], tuple[list[ConvState], Counter]] = {}
        open_convs = 0
        threads = [
            threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(len(self.backend.slots))
        ]
        for t in threads:
            t.start()
        try:
            while pending or open_chunks:
                while pending and (not open_chunks or open_convs < window):
                    split, index, members = pending.pop()
                    states = [
                        ConvState(
                            c,
                            (split, index),
                            [m for m in c.messages if m["role"] == "system"],
                            [m for m in c.messages if m["role"] == "user"],
                        )
                        for c in members
                    ]
                    for st in states:  # round robin in the longest-first order: every server gets long chains
                        st.server = self.opened % len(self.ready)
                        self.opened += 1
                    skips: Counter = Counter()
                    open_chunks[(split, index)] = (states, skips)
                    self.left[(split, index)] = len(states)
                    open_convs += len(states)
                    for s in states:
                        self._advance(s, skips)
                    open_convs -= self._commit_done(open_chunks)
                if not open_chunks:
                    continue
                kind, payload = self.results.get()
                if kind == "error":
                    raise RegenError(f"regeneration stopped, committed chunks kept (rerun to resume): {payload}")
                for s, a in payload:
                    self._take(s, a)
                    self._advance(s, open_chunks[s.chunk][1])
                self.bar.set_postfix_str(
                    f"answer tok/s {self.stats.answer_tokens / max(time.time() - self.t0, 1e-9):,.0f}", refresh=False
                )
                open_convs -= self._commit_done(open_chunks)
        finally:
            self.stop.set()
            deadline = time.time() + 2.0  # workers still inside a request are daemons: not waited for long
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.time()))

    def _advance(self, s: ConvState, skips: Counter) -> None:
        g = self._next(s, skips)
        if g is not None:
            self.ready[s.server].put(s, g)
            return
        if s.turn:
            s.sample = TokenSample(
                sample_id(s.conv.key), s.ids, s.mask, turns=s.turn, unfinished=s.unfinished, source=s.conv.source
            )
        self.left[s.chunk] -= 1
        self.bar.update(1)

    def _commit_done(self, open_chunks: dict) -> int:
        closed = 0
        for key in [k for k in open_chunks if self.left[k] == 0]:
            states, skips = open_chunks.pop(key)
            del self.left[key]
            self.writer.commit(key[0], key[1], [s.sample for s in states if s.sample is not None], dict(skips))
            closed += len(states)
        return closed


# --------------------------------------------------------------------------- the job


def longest_first(convs: list[Conversation]) -> list[Conversation]:
    """The conversations with the most user turns first (stable): their turns run one after another, so opened
    last they would leave the servers a long tail of few requests in flight (RESULTS §7a)."""
    return sorted(convs, key=lambda c: -sum(m["role"] == "user" for m in c.messages))


def fingerprint(cfg: Config, convs: list[Conversation]) -> str:
    """What must match for a rerun to resume: the conversation order and how answers are made."""
    h = to_dict(cfg.harvest)
    gen_keys = (
        "sources",
        "max_turns",
        "max_prompt_tokens",
        "max_total_tokens",
        "max_new_tokens",
        "temperature",
        "top_p",
        "heldout_fraction",
        "dedupe",
        "shard_samples",
    )
    what = {
        "keys": [(c.key, c.split) for c in convs],
        "harvest": {k: h[k] if k != "sources" else source_identity(cfg.harvest.sources) for k in gen_keys},
        "chat_template": cfg.target.chat_template,
        "seed": cfg.seed,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def main(cfg: Config, run_dir: str | Path, record: bool = False) -> dict:
    """The whole regeneration; returns the summary. Inputs are checked before the target is reached. With `record`
    the config goes into run_dir/config.yaml once the token store has accepted this regeneration."""
    t0 = time.time()
    h = cfg.harvest
    run_dir = Path(run_dir)
    check_harvest_config(h)
    for src in h.sources:
        check_source(src)
    if not h.regenerate:
        raise ValueError("harvest.regenerate is false: regeneration writes every answer with the target")
    tokenizer = load_tokenizer(cfg.target)
    chat = ChatFormat(tokenizer, cfg.target.chat_template)

    def prompt_fits(messages: list[dict]) -> str | None:
        first = [m for m in messages if m["role"] == "system"] + [next(m for m in messages if m["role"] == "user")]
        return (
            "too_long_prompt" if len(chat.encode(first, add_generation_prompt=True)[0]) > h.max_prompt_tokens else None
        )

    prompt_skips: Counter = Counter()
    convs = collect(
        h.sources,
        max_turns=h.max_turns,
        regenerate=True,
        heldout_fraction=h.heldout_fraction,
        dedupe=h.dedupe,
        skips=prompt_skips,
        check=prompt_fits,
    )
    if not convs:
        raise ValueError(f"no usable conversation in harvest.sources (skips: {dict(prompt_skips)})")

    identity = {
        "target": cfg.target.name,
        "tokenizer_sha256": tokenizer_digest(tokenizer),
        "vocab_size": len(tokenizer),
        "chat_template": cfg.target.chat_template,
        "stop_ids": list(chat.stop_ids),
    }
    convs = longest_first(convs)
    writer = TokenWriter(RunDir(run_dir).tokens, identity, fingerprint(cfg, convs))
    if record:
        save_resolved(cfg, run_dir, "regen")
    chunks = []
    for split in reversed(SPLITS):  # held-out first: it is small, and a run cut short still has its eval set
        members = [c for c in convs if c.split == split]
        chunks += [
            (split, i // h.shard_samples, members[i : i + h.shard_samples])
            for i in range(0, len(members), h.shard_samples)
        ]
    todo = [(s, i, m) for s, i, m in chunks if i not in writer.done(s)]

    sampling = Sampling(temperature=h.temperature, top_p=h.top_p)
    backend = open_backend(cfg, sampling, chat.stop_ids)
    t_work = time.time()
    done_before = len(convs) - sum(len(m) for _, _, m in todo)
    with tqdm(
        total=len(convs),
        initial=done_before,
        unit="conv",
        desc="regen",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=1.0,
    ) as bar:
        regen = Regenerator(cfg, chat, backend, writer, bar)
        regen.run(todo)
    work_s = time.time() - t_work

    m = writer.manifest
    skips = Counter(prompt_skips) + Counter(m["chunk_skips"])
    writer.finish({"skips": dict(sorted(skips.items())), "prompt_skips": dict(sorted(prompt_skips.items()))})
    st = regen.stats
    summary = {
        "answer_tokens": st.answer_tokens,
        "answers": st.answers,
        "unfinished_answers": st.unfinished,
        "wall_s": round(work_s, 2),
        "answer_tokens_per_s": round(st.answer_tokens / max(work_s, 1e-9), 1),
        "counts": m["counts"],
        "skips": dict(sorted(skips.items())),
        "chunks": len(chunks),
        "chunks_resumed": len(chunks) - len(todo),
        "output_ids_trimmed": backend.trimmed,
        "generation": {
            **backend.describe(),
            "max_new_tokens": h.max_new_tokens,
            "max_total_tokens": h.max_total_tokens,
            "max_turns": h.max_turns,
            "temperature": h.temperature,
        },
        "time_s": round(time.time() - t0, 2),
    }
    write_atomic(RunDir(run_dir).tokens / "summary.json", json.dumps(summary, indent=1))
    return summary


def cli(argv: list[str] | None = None) -> None:
    from eagle3ft.targets.sglang import SGLangError

    cfg, run_dir, _ = parse_cli(
        "Regenerate every assistant turn with the target into a token store.", stage="regen", argv=argv, record=False
    )
    with (
        holding(run_dir, "regen"),
        cli_errors("regen", RegenError, SGLangError, StoreError, log=error_log(run_dir, "regen")),
    ):
        summary = main(cfg, run_dir, record=True)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    cli()
