"""Prompts written by the target itself (Magpie): the chat template up to the user turn's header, then the target
samples the user turn until its end-of-turn id.

    eagle3ft magpie --config CFG --run-dir RUN

writes ``RUN/magpie/prompts.jsonl`` (one ``{"id", "messages": [user turn]}`` per line), which regeneration reads
as any other source: ``harvest.sources: [{kind: file, path: RUN/magpie/prompts.jsonl}]``. Settings:
``harvest.magpie`` (count, temperature, top_p, max_tokens, seed, ...); the backend is regeneration's
(``harvest.backend``: the embedded target or SGLang servers, ``/generate`` with input_ids, batched).

A draw k is sampled with its own seed (from ``magpie.seed`` and k) and is dropped, counted by reason, when it is
unfinished (cut by max_tokens), empty, too short or long, holds non-printable characters or a template token, is
an exact or a near duplicate (equal once lowercased and stripped of punctuation) of a kept prompt, or shares an
8-gram with a held-out set (``magpie.heldout``, data/contamination.py). Draws are made in chunks of
``magpie.chunk``; each chunk's kept lines are appended and flushed, then ``state.json`` (draws done, the file's
length, the counts) is replaced atomically: a killed run resumes from the last state, cutting the file back to its
recorded length, so no prompt is lost or written twice. A rerun with a larger ``count`` (or ``max_draws``) draws on
from where the last one stopped; other changed settings are refused.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # run as a script (`eagle3ft STAGE` sets it in eagle3ft/commands.py); before torch loads
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import hashlib
import json
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from eagle3ft.cli import run_stage
from eagle3ft.config import Config, HarvestConfig, TargetConfig, to_dict
from eagle3ft.data.chat import ChatFormat
from eagle3ft.data.contamination import HeldoutGrams, words
from eagle3ft.data.regen_backends import Gen, RegenError, open_backend
from eagle3ft.files import json_text, write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.targets.base import Sampling
from eagle3ft.targets.hf import load_tokenizer

_SENTINEL = "\x00MAGPIE\x00"


def user_header_ids(chat: ChatFormat) -> list[int]:
    """The template rendered up to and including the first user turn's header (a default system turn included)."""
    text = chat.render([{"role": "user", "content": _SENTINEL}])
    head = text[: text.index(_SENTINEL)]
    return list(chat.tokenizer(head, add_special_tokens=False)["input_ids"])


def draw_seed(seed: int, k: int) -> int:
    return int(hashlib.sha256(f"magpie:{seed}:{k}".encode()).hexdigest()[:8], 16)


class PromptFilter:
    """Keeps a user turn or names why not; remembers what it kept (exact text and normalised text)."""

    def __init__(self, m, grams: HeldoutGrams, template_tokens: list[str]):
        self.m, self.grams, self.template_tokens = m, grams, template_tokens
        self.exact: set[str] = set()
        self.near: set[str] = set()

    def reason(self, text: str, finished: bool) -> str | None:
        t = text.strip()
        if not finished:
            return "unfinished"
        if not t:
            return "empty"
        if len(t) < self.m.min_chars:
            return "too_short"
        if len(t) > self.m.max_chars:
            return "too_long"
        if any(not (c.isprintable() or c in "\n\t") for c in t):
            return "non_printable"
        if any(tok in t for tok in self.template_tokens):
            return "template_token"
        if t in self.exact:
            return "duplicate"
        if " ".join(words(t)) in self.near:
            return "near_duplicate"
        if self.grams.hits(t):
            return "heldout_8gram"
        return None

    def keep(self, text: str) -> None:
        t = text.strip()
        self.exact.add(t)
        self.near.add(" ".join(words(t)))


def fingerprint(harvest: HarvestConfig, target: TargetConfig) -> str:
    m = to_dict(harvest.magpie)
    what = {
        "magpie": {k: v for k, v in m.items() if k not in ("count", "max_draws", "chunk")},
        "chunk": m["chunk"],
        "target": target.name,
        "chat_template": target.chat_template,
        "backend": harvest.backend,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _resume(out: Path, state_path: Path, fp: str, flt: PromptFilter) -> dict:
    """The state of an earlier run (the file cut back to its committed length), or a fresh one."""
    if not state_path.is_file():
        out.unlink(missing_ok=True)
        return {"fingerprint": fp, "draws": 0, "bytes": 0, "kept": 0, "filtered": {}}
    state = json.loads(state_path.read_text())
    if state.get("fingerprint") != fp:
        raise RegenError(f"{state_path}: written with other magpie settings; remove {out.parent} to start over")
    out.touch()
    with open(out, "r+b") as f:
        f.truncate(state["bytes"])
    with open(out, encoding="utf-8") as f:
        for line in f:
            flt.keep(json.loads(line)["messages"][0]["content"])
    return state


def _generate(backend, gens: list[Gen]) -> list:
    """Answers for `gens` in order, batches spread over the backend's slots."""
    step = backend.batch
    batches = [gens[i : i + step] for i in range(0, len(gens), step)]
    with ThreadPoolExecutor(max_workers=len(backend.slots)) as pool:
        parts = pool.map(lambda ib: backend.generate(ib[0] % len(backend.slots), ib[1]), enumerate(batches))
        return [a for part in parts for a in part]


def run_magpie(cfg: Config, run_dir: str | Path) -> dict:
    """Draw prompts until `magpie.count` are kept (or `max_draws` are made); returns the summary."""
    m = cfg.harvest.magpie
    folder = RunDir(run_dir).magpie
    folder.mkdir(parents=True, exist_ok=True)
    out, state_path = folder / "prompts.jsonl", folder / "state.json"
    tokenizer = load_tokenizer(cfg.target)
    chat = ChatFormat(tokenizer, cfg.target.chat_template)
    header = user_header_ids(chat)
    specials = [t for t in tokenizer.all_special_tokens if t] + list(
        getattr(tokenizer, "additional_special_tokens", [])
    )
    flt = PromptFilter(m, HeldoutGrams(m.heldout), specials)
    state = _resume(out, state_path, fingerprint(cfg.harvest, cfg.target), flt)
    filtered = Counter(state["filtered"])
    max_draws = m.max_draws or 20 * m.count
    backend = open_backend(cfg.target, cfg.harvest, Sampling(temperature=m.temperature, top_p=m.top_p), chat.stop_ids)
    with tqdm(total=m.count, initial=state["kept"], unit="prompt", desc="magpie", file=sys.stderr) as bar:
        while state["kept"] < m.count and state["draws"] < max_draws:
            first = state["draws"]
            ks = range(first, min(first + m.chunk, max_draws))
            answers = _generate(backend, [Gen(header, m.max_tokens, draw_seed(m.seed, k)) for k in ks])
            lines = []
            for k, a in zip(ks, answers):
                state["draws"] = k + 1
                text = chat.decode(a.ids).strip()
                why = flt.reason(text, a.finished)
                if why:
                    filtered[why] += 1
                    continue
                flt.keep(text)
                record = {"id": f"magpie-{m.seed}-{k}", "messages": [{"role": "user", "content": text}]}
                lines.append(json_text(record, str(out), ensure_ascii=False) + "\n")
                if state["kept"] + len(lines) >= m.count:
                    break
            with open(out, "ab") as f:
                f.write("".join(lines).encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
                state["bytes"] = f.tell()
            state["kept"] += len(lines)
            state["filtered"] = dict(sorted(filtered.items()))
            write_json(state_path, state)
            bar.update(len(lines))
    summary = {
        "prompts": str(out),
        "kept": state["kept"],
        "draws": state["draws"],
        "filtered": state["filtered"],
        "temperature": m.temperature,
        "top_p": m.top_p,
        "generation": backend.describe(),
    }
    write_json(folder / "summary.json", summary)
    return summary


def main(argv: list[str] | None = None) -> None:
    from eagle3ft.targets.sglang import SGLangError

    run_stage("Prompts written by the target (Magpie).", "magpie", run_magpie, RegenError, SGLangError, argv=argv)


if __name__ == "__main__":
    main()
