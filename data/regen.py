"""Regeneration: prompts -> the target writes every assistant turn -> the token store ``RUN/tokens/``.

    eagle3ft regen --config CFG --run-dir RUN

The conversations (``harvest.sources``) are put in a fixed order (most user turns first) and cut into
chunks of ``harvest.shard_samples`` per split; a chunk is committed whole as one
shard of data/tokens.py once all its conversations are done. Rerunning the same
command skips the committed chunks, so a killed run resumes, losing and
duplicating nothing.

Stopping early keeps what was generated: once ``harvest.max_seconds`` have passed since the first turn was sent
(0: no budget), or on a first SIGINT/SIGTERM, no new turn is sent, the turns in flight are waited for (60 s at
most), and every open chunk is committed with each unfinished conversation cut at the end of its last answer
(data/regen_turns.py): every answer that came back is kept; a conversation with no answer yet, and a turn still in
flight after the wait, are dropped. A signal while a stop is under way (a second one, or one after the budget ran
out) aborts at once, losing the open chunks as a kill does. A chunk
committed cut is done: a rerun does the chunks never opened and leaves the cut ones cut (the manifest lists them in
``chunks_cut``; the skips count ``turns_cut_by_stop`` and ``conversations_cut_by_stop_before_an_answer``), so a
rerun duplicates nothing. A kill -9 still loses only the open chunks.

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

A summary (answer tokens, wall time, answer tokens/s, per-split counts; ``stopped``: why the run stopped early,
the conversations cut and dropped, the turns not sent and dropped in flight, the chunks cut and left) goes to
stdout and ``RUN/tokens/summary.json``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # run as a script (`eagle3ft STAGE` sets it in eagle3ft/commands.py); before torch loads
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import hashlib
import json
import signal
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from eagle3ft.cli import run_stage, save_resolved
from eagle3ft.config import Config, HarvestConfig, TargetConfig, to_dict
from eagle3ft.data.chat import ChatFormat
from eagle3ft.data.harvest import check_harvest_config, conversations
from eagle3ft.data.prompts import Conversation, check_source, source_identity
from eagle3ft.data.regen_backends import RegenError, open_backend
from eagle3ft.data.regen_turns import Regenerator
from eagle3ft.data.store import SPLITS, StoreError
from eagle3ft.data.tokens import TokenWriter, tokenizer_digest
from eagle3ft.files import write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.targets.base import Sampling
from eagle3ft.targets.hf import load_tokenizer

# --------------------------------------------------------------------------- the job


def longest_first(convs: list[Conversation]) -> list[Conversation]:
    """The conversations with the most user turns first (stable): their turns run one after another, so opened
    last they would leave the servers a long tail of few requests in flight."""
    return sorted(convs, key=lambda c: -sum(m["role"] == "user" for m in c.messages))


def fingerprint(harvest: HarvestConfig, target: TargetConfig, seed: int, convs: list[Conversation]) -> str:
    """What must match for a rerun to resume: the conversation order and how answers are made."""
    h = to_dict(harvest)
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
        "harvest": {k: h[k] if k != "sources" else source_identity(harvest.sources) for k in gen_keys},
        "chat_template": target.chat_template,
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


@contextmanager
def stop_on_signals(regen: Regenerator):
    """While regenerating: a first SIGINT or SIGTERM stops the run as ``harvest.max_seconds`` does (data/regen_turns.py:
    open chunks committed cut); one that comes while a stop is under way (a second signal, or one after the budget
    ran out) aborts at once (KeyboardInterrupt: open chunks lost, committed ones kept). Python delivers signals to the
    main thread only: from another thread this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if regen.stop_reason is not None:
            raise KeyboardInterrupt
        regen.request_stop(signal.Signals(signum).name)

    before = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)


def run_regen(cfg: Config, run_dir: str | Path, record: bool = False) -> dict:
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

    convs, prompt_skips = conversations(h, prompt_fits, regenerate=True)

    identity = {
        "target": cfg.target.name,
        "tokenizer_sha256": tokenizer_digest(tokenizer),
        "vocab_size": len(tokenizer),
        "chat_template": cfg.target.chat_template,
        "stop_ids": list(chat.stop_ids),
    }
    convs = longest_first(convs)
    writer = TokenWriter(RunDir(run_dir).tokens, identity, fingerprint(cfg.harvest, cfg.target, cfg.seed, convs))
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
    backend = open_backend(cfg.target, cfg.harvest, sampling, chat.stop_ids)
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
        regen = Regenerator(cfg.harvest, cfg.seed, chat, backend, writer, bar)
        with stop_on_signals(regen):
            regen.run(todo)
    work_s = time.time() - t_work

    m = writer.manifest
    skips = Counter(prompt_skips) + Counter(m["chunk_skips"])
    writer.finish(
        {"skips": dict(sorted(skips.items())), "prompt_skips": dict(sorted(prompt_skips.items()))},
        complete=not (regen.stopped and regen.stopped.chunks_left),
    )
    st = regen.stats
    summary = {
        "answer_tokens": st.answer_tokens,  # all of them in the store, also after a stop
        "stopped": regen.stop_summary(),  # None, or why and what was cut (data/regen_turns.py)
        "answers": st.answers,
        "unfinished_answers": st.unfinished,
        "wall_s": round(work_s, 2),
        "answer_tokens_per_s": round(st.answer_tokens / max(work_s, 1e-9), 1),
        "counts": m["counts"],
        "skips": dict(sorted(skips.items())),
        "skipped_at": dict(sorted(prompt_skips.at.items())),  # the prompt records skipped: their file:line
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
    write_json(RunDir(run_dir).tokens / "summary.json", summary)
    return summary


def main(argv: list[str] | None = None) -> None:
    from eagle3ft.targets.sglang import SGLangError

    def work(cfg: Config, run_dir: Path) -> dict:
        return run_regen(cfg, run_dir, record=True)

    description = "Regenerate every assistant turn with the target into a token store."
    run_stage(description, "regen", work, RegenError, SGLangError, StoreError, argv=argv)


if __name__ == "__main__":
    main()
