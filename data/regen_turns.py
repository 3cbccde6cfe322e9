"""Conversations in flight for data/regen.py: turn by turn through the backend's workers, chunks committed as they
complete, and the stop (``harvest.max_seconds`` or a first SIGINT/SIGTERM) that commits the open chunks cut.

A stop sends no new turn and opens no new chunk. The turns queued but not yet sent are withdrawn; the turns in
flight are waited for, at most DRAIN_S seconds, and their answers kept. Then every open chunk is committed with
each unfinished conversation cut at the end of its last answer (`ConvState.kept`): every answer that came back is
in the store, a conversation with no answer yet is not, and a turn still in flight after DRAIN_S is dropped (its
answer never reached the client, so its tokens are not known). The chunks not yet opened are left to a rerun.
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from tqdm import tqdm

from eagle3ft.config import HarvestConfig
from eagle3ft.data.chat import ChatFormat
from eagle3ft.data.harvest import request_seed
from eagle3ft.data.prompts import Conversation
from eagle3ft.data.regen_backends import Answer, Gen, HFBackend, RegenError, SGLangBackend
from eagle3ft.data.sources import sample_id
from eagle3ft.data.tokens import TokenSample, TokenWriter

DRAIN_S = 60.0  # after a stop, the longest wait for the turns in flight (a turn ends within max_new_tokens)


@dataclass
class ConvState:
    """One conversation being regenerated; only the main thread touches it."""

    conv: Conversation
    chunk: tuple[str, int]
    head: list[dict]  # system message, if any
    users: list[dict]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    kept: int = 0  # len(ids) at the end of the last answer: where a stop cuts the conversation
    turn: int = 0  # assistant turns written
    unfinished: int = 0
    answers: list[str] = field(default_factory=list)  # decoded answers: the history the template renders
    sample: TokenSample | None = None
    done: bool = False
    server: int = 0  # every turn goes to this server (its prefix cache holds the conversation so far)

    def as_sample(self) -> TokenSample:
        """The conversation up to the end of its last answer."""
        return TokenSample(
            sample_id(self.conv.key),
            self.ids[: self.kept],
            self.mask[: self.kept],
            turns=self.turn,
            unfinished=self.unfinished,
            source=self.conv.source,
        )


@dataclass
class RunStats:
    answer_tokens: int = 0
    answers: int = 0
    unfinished: int = 0


@dataclass
class StopStats:
    """What a stop cut; `Regenerator.stop_summary` reports it."""

    reason: str
    after_s: float
    turns_not_sent: int = 0  # queued, withdrawn
    turns_dropped_in_flight: int = 0  # sent, not back within DRAIN_S
    conversations_cut: int = 0  # committed at the end of their last answer, with user turns left unanswered
    conversations_dropped: int = 0  # no answer back yet: not in the store (their chunk is done)
    chunks_cut: int = 0
    chunks_left: int = 0  # never opened: a rerun does them


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
    """Moves conversations turn by turn through the backend's workers; commits chunks as they complete.

    `request_stop(reason)` (a signal handler calls it) or ``harvest.max_seconds`` ends the run early (module
    docstring)."""

    def __init__(
        self,
        harvest: HarvestConfig,
        seed: int,
        chat: ChatFormat,
        backend: HFBackend | SGLangBackend,
        writer: TokenWriter,
        bar: tqdm,
    ):
        self.h, self.seed, self.chat, self.backend, self.writer, self.bar = (
            harvest,
            seed,
            chat,
            backend,
            writer,
            bar,
        )
        self.ready = [ReadyTurns() for _ in range(backend.servers)]
        self.opened = 0  # conversations opened so far: the next one's server is opened % servers
        self.results: queue.Queue = queue.Queue()
        self.stop = threading.Event()  # the workers' exit
        self.stats = RunStats()
        self.left: dict[tuple[str, int], int] = {}  # conversations of an open chunk not done yet
        self.in_flight = 0  # turns queued or sent whose answer has not come back
        self.stop_reason: str | None = None
        self.stopped: StopStats | None = None
        self.t0 = time.time()

    def request_stop(self, reason: str) -> None:
        """Stop at the next turn of the run loop (safe from a signal handler: it only sets a field)."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def _stopping(self) -> bool:
        if self.stop_reason is None and self.h.max_seconds and time.time() - self.t0 >= self.h.max_seconds:
            self.stop_reason = "max_seconds"
        return self.stop_reason is not None

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
        s.kept = len(s.ids)
        s.turn += 1
        s.unfinished += not a.finished
        s.answers.append(self.chat.decode(a.ids))
        self.stats.answer_tokens += len(a.ids)
        self.stats.answers += 1
        self.stats.unfinished += not a.finished
        self.in_flight -= 1

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
                self.results.put(("error", (f"{self.backend.slots[slot]}: {e}", len(batch))))
                return
            self.results.put(("ok", [(s, a) for (s, _), a in zip(batch, answers)]))

    # ------------------------------------------------------------------ the run

    def run(self, todo: list[tuple[str, int, list[Conversation]]]) -> None:
        """Regenerate every chunk of `todo`; chunks are opened while fewer than a window of conversations is open.
        After a stop, the open chunks are committed cut and the rest of `todo` is left (`self.stopped`)."""
        capacity = len(self.backend.slots) * self.backend.batch
        window = max(4 * capacity, 1)
        pending = list(reversed(todo))
        open_chunks: dict[tuple[str, int], tuple[list[ConvState], Counter]] = {}
        open_convs = 0
        threads = [
            threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(len(self.backend.slots))
        ]
        self.t0 = time.time()
        for t in threads:
            t.start()
        try:
            while (pending or open_chunks) and not self._stopping():
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
                try:  # a timeout, so that a stop (the budget, a signal) is seen while every turn is out
                    kind, payload = self.results.get(timeout=0.2)
                except queue.Empty:
                    continue
                if kind == "error":
                    raise RegenError(f"regeneration stopped, committed chunks kept (rerun to resume): {payload[0]}")
                for s, a in payload:
                    self._take(s, a)
                    self._advance(s, open_chunks[s.chunk][1])
                self.bar.set_postfix_str(
                    f"answer tok/s {self.stats.answer_tokens / max(time.time() - self.t0, 1e-9):,.0f}", refresh=False
                )
                open_convs -= self._commit_done(open_chunks)
            if self.stop_reason is not None:
                self._wind_down(open_chunks, len(pending))
        finally:
            self.stop.set()
            deadline = time.time() + 2.0  # workers still inside a request are daemons: not waited for long
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.time()))

    def _advance(self, s: ConvState, skips: Counter) -> None:
        g = self._next(s, skips)
        if g is not None:
            self.ready[s.server].put(s, g)
            self.in_flight += 1
        else:
            self._finish(s)

    def _finish(self, s: ConvState) -> None:
        if s.turn:
            s.sample = s.as_sample()
        s.done = True
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

    # ------------------------------------------------------------------ the stop

    def _wind_down(self, open_chunks: dict, chunks_left: int) -> None:
        """No new turn; the answers in flight kept (DRAIN_S at most); every open chunk committed cut."""
        st = self.stopped = StopStats(self.stop_reason or "", round(time.time() - self.t0, 2), chunks_left=chunks_left)
        for ready in self.ready:
            while True:
                try:
                    ready.get_nowait()
                except queue.Empty:
                    break
                st.turns_not_sent += 1
                self.in_flight -= 1
        print(
            f"regen: stopping ({st.reason}) after {st.after_s:.0f} s: no new turn; waiting up to {DRAIN_S:.0f} s "
            f"for {self.in_flight} turns in flight, then {len(open_chunks)} open chunks are committed cut",
            file=sys.stderr,
            flush=True,
        )
        deadline = time.time() + DRAIN_S
        while self.in_flight > 0 and time.time() < deadline:
            try:
                kind, payload = self.results.get(timeout=min(0.2, max(deadline - time.time(), 0.0)))
            except queue.Empty:
                continue
            if kind == "error":  # that server's turns are lost; the other answers are still kept
                print(f"regen: while stopping: {payload[0]}", file=sys.stderr, flush=True)
                self.in_flight -= payload[1]
                continue
            for s, a in payload:
                self._take(s, a)
                if self._next(s, open_chunks[s.chunk][1]) is None:  # its last turn: whole, not cut
                    self._finish(s)  # (a next turn's prompt ids, were there one, lie past s.kept)
        st.turns_dropped_in_flight = self.in_flight
        for (split, index), (states, skips) in sorted(open_chunks.items()):
            samples, before = [], st.conversations_cut + st.conversations_dropped
            for s in states:
                if s.done:
                    if s.sample is not None:
                        samples.append(s.sample)
                elif s.turn:
                    samples.append(s.as_sample())
                    st.conversations_cut += 1
                    skips["turns_cut_by_stop"] += len(s.users) - s.turn
                else:
                    st.conversations_dropped += 1
                    skips["conversations_cut_by_stop_before_an_answer"] += 1
            cut = st.conversations_cut + st.conversations_dropped > before
            self.writer.commit(split, index, samples, dict(skips), cut=cut)
            st.chunks_cut += cut
        open_chunks.clear()

    def stop_summary(self) -> dict | None:
        """The stop's figures for the summary (None when the run was not stopped)."""
        if self.stopped is None:
            return None
        return {**vars(self.stopped), "answer_tokens_kept": self.stats.answer_tokens, "drain_s": DRAIN_S}
