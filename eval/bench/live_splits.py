"""What a live bench's passes give beyond the decode-only tok/s: the end-to-end figure a user's client sees, and every
figure again on the loop-free tokens and on the answers that finished before the cap. What a loop is, is
data/loops.py's (a token is repeated when the 8-gram ending at it occurred earlier in the same answer; a loop is a run
of >= 8 repeated tokens); a tiny target at T=0 falls into them, and a user's traffic does not loop like that.

- **e2e**: answer tokens over the wall time of the requests (the prompt's prefill and the transport included):
  SGLang's non-streamed requests (`bench.sglang.requests` "whole"), else its streamed ones' wall time, else the
  embedded decoder's prefill + decode. Per repetition, pooled over the prompts; the speed-up against the same
  repetition's plain pass (`speedup_paired`) and of the medians.
- **loop_free**: tau and decode tok/s on the tokens outside loops. An answer is cut into the spans it was emitted in,
  each with its verifies and seconds: a verify's accepted tokens (embedded, in order), or a streamed event (SGLang:
  exact when the stream has one event per verify, else the request's verifies shared out over its events by their
  seconds, cycles costing about the same); a plain answer's tokens each cost one step. A non-streamed SGLang answer
  has no spans: it counts in `all` and `finished` only (`unresolved`).
- **finished**: tau over the answers that stopped on a stop id, and the e2e speed-up over the (prompt, repetition)
  pairs where both the plain and the speculative answer finished.
- **loop_free_answers**: the same over the answers with no loop at all; exact without spans, so it is what a
  non-streamed run gives in place of `loop_free`.

`python -m eagle3ft.eval.bench.live_splits RUN/bench/runs.jsonl [--cap N]` prints these figures for every arm of a bench's
raw runs; with `--cap`, of its streamed requests cut at N new tokens (`cut_at`): what a shorter cap would have given on
the same answers, read off one run rather than measured by a second.
"""

from __future__ import annotations

import statistics
from dataclasses import astuple, dataclass

from eagle3ft.data.loops import loop_mask
from eagle3ft.files import json_text


@dataclass
class Split:
    """Tokens, verifies and seconds of one part of the answers (verifies and seconds may be fractional: shared)."""

    tokens: float = 0.0
    verifies: float = 0.0
    seconds: float = 0.0
    verified: float = 0.0  # the tokens of spans a verify emitted (not the prefill's first token)

    def __add__(self, o: "Split") -> "Split":
        return Split(*(a + b for a, b in zip(astuple(self), astuple(o))))

    @property
    def tau(self) -> float | None:
        """Tokens per verify, the bonus token included (SGLang's spec_accept_length without the prefill's token)."""
        return self.verified / self.verifies if self.verifies > 0 else None

    @property
    def tok_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


def split_spans(loop: list[bool], spans: list[tuple[int, float, float]]) -> tuple[Split, Split]:
    """(loop-free, loop) totals of an answer emitted in `spans`, each (tokens, verifies, seconds) in order: a verify's
    accepted tokens or a streamed chunk. Each span's verifies and seconds are shared out between its loop and
    loop-free tokens in proportion to their counts, exact for a span that lies wholly on one side; tokens past the
    mask's end count as loop-free."""
    free, looped, pos = Split(), Split(), 0
    for n, v, s in spans:
        k = sum(loop[pos : pos + n])
        if n > 0:
            by_verify = 1.0 if v > 0 else 0.0
            looped += Split(k, v * k / n, s * k / n, by_verify * k)
            free += Split(n - k, v * (n - k) / n, s * (n - k) / n, by_verify * (n - k))
        pos += n
    return free, looped


def e2e_of(r: dict) -> tuple[int, float]:
    """(answer tokens, seconds) of one request as a user's client times it."""
    if r.get("whole"):
        return int(r["whole"]["new_tokens"]), float(r["whole"]["wall_s"])
    if r.get("wall_s") is not None:
        return int(r["new_tokens"]), float(r["wall_s"])
    return int(r["new_tokens"]), float(r["prefill_s"]) + float(r["decode_s"])


def spans_of(r: dict) -> list[tuple[int, float, float]] | None:
    """(tokens, verifies, seconds) per span of one decoded answer, in order; the first span is the prefill's token.
    None when the answer's spans are unknown (a non-streamed SGLang answer)."""
    n, verifies = int(r["new_tokens"]), r.get("verify_count")
    if r.get("events"):
        t = [e[0] for e in r["events"]]
        counts = [int(e[1]) for e in r["events"]]
        sizes = [counts[0]] + [b - a for a, b in zip(counts, counts[1:])]
        secs = [0.0] + [b - a for a, b in zip(t, t[1:])]
        if not verifies:
            return list(zip(sizes, [0.0] * len(sizes), secs))
        if len(sizes) == verifies + 1:
            return list(zip(sizes, [0.0] + [1.0] * verifies, secs))
        total = sum(secs) or 1.0
        return list(zip(sizes, [verifies * s / total for s in secs], secs))
    if r.get("accept_lengths") and r.get("cycle_s") is not None:  # embedded: each verify's tokens, in order
        acc = r["accept_lengths"]
        return [(n - sum(acc), 0.0, 0.0)] + [(a, 1.0, c) for a, c in zip(acc, r["cycle_s"])]
    if not verifies and r.get("whole") is None and n > 1:  # plain, embedded: each token one step
        step = float(r["decode_s"]) / (n - 1)
        return [(1, 0.0, 0.0)] + [(1, 0.0, step)] * (n - 1)
    return None


def cut_at(r: dict, cap: int) -> dict:
    """A streamed request as it would have run with at most `cap` new tokens. At T=0 the answer is the same greedy
    path whatever the cap, so it is this answer's first `cap` tokens, and the server stops after the event (plain: the
    token; speculative: the verify) that reaches the cap: its time since the first token, plus the prefill, is the
    wall time. The non-streamed twin (`whole`) cannot be cut and is dropped; an answer longer than the cap did not
    finish. Needs the events (`bench.sglang.requests` "stream")."""
    if not r.get("events"):
        raise ValueError(f"prompt {r.get('prompt_index')}: no streamed events to cut at {cap} tokens")
    n = int(r["new_tokens"])
    if n <= cap:
        return {**r, "whole": None}
    kept = next(i for i, (_, count) in enumerate(r["events"]) if count >= cap) + 1
    events = [list(e) for e in r["events"][:kept]]
    events[-1][1] = cap
    decode_s = float(events[-1][0])
    verifies = r.get("verify_count")
    if verifies and len(r["events"]) != verifies + 1:  # merged events: the verifies shared out by time, as spans_of
        verifies = round(verifies * decode_s / float(r["events"][-1][0]))
    elif verifies:
        verifies = kept - 1
    return {
        **r,
        "new_tokens": cap,
        "output_ids": list(r["output_ids"])[:cap] if r.get("output_ids") is not None else None,
        "events": events,
        "verify_count": verifies,
        "decode_s": decode_s,
        "wall_s": float(r["prefill_s"]) + decode_s,
        "finished": False,
        "whole": None,
    }


def _row_splits(r: dict) -> tuple[Split, Split, bool] | None:
    """(loop-free, loop, whether the answer loops) of one request, or None without spans."""
    ids = r.get("output_ids")
    spans = spans_of(r)
    if ids is None or spans is None:
        return None
    loop = loop_mask(list(ids))
    free, looped = split_spans(loop, spans)
    return free, looped, any(loop)


def _tau(tokens: float, verifies: float) -> float | None:
    return tokens / verifies if verifies else None


def arm_figures(rows: list[dict], plain: list[dict] | None) -> dict:
    """The e2e, loop-free and finished figures of one arm's rows (all repetitions); `plain` the baseline's rows for
    the speed-ups (None for the baseline itself)."""
    by_rep: dict[int, list[dict]] = {}
    for r in rows:
        by_rep.setdefault(r["repetition"], []).append(r)
    e2e = {rep: _pooled_tok_s([e2e_of(r) for r in rs]) for rep, rs in sorted(by_rep.items())}
    out: dict = {"e2e": {"tok_s": spread(list(e2e.values())), "timing": _timing(rows)}}
    streamed = {  # beside a non-streamed e2e: the streamed requests' own wall time
        rep: _pooled_tok_s([(int(r["new_tokens"]), float(r["wall_s"])) for r in rs])
        for rep, rs in sorted(by_rep.items())
        if all(r.get("whole") and r.get("events") and r.get("wall_s") for r in rs)
    }
    if streamed:
        out["stream_wall"] = {"tok_s": spread(list(streamed.values()))}
    free, looped, unresolved, looping = Split(), Split(), 0, 0
    for r in rows:
        got = _row_splits(r)
        if got is None:
            unresolved += 1
            continue
        free, looped, looping = free + got[0], looped + got[1], looping + got[2]
    tokens = sum(int(r["new_tokens"]) for r in rows)
    verifies = sum(int(r.get("verify_count") or 0) for r in rows)
    out["all"] = {"tokens": tokens, "verifies": verifies, "tau": _tau(tokens - _prefill_tokens(rows), verifies)}
    out["loop_free"] = {
        "tokens": free.tokens,
        "loop_tokens": looped.tokens,
        "loop_share": looped.tokens / (free.tokens + looped.tokens) if free.tokens + looped.tokens else None,
        "tau": free.tau,
        "tau_loops": looped.tau,
        "decode_tok_s": free.tok_s,
        "answers_looping": looping,
        "unresolved": unresolved,
    }
    free_answers = [r for r in rows if r.get("output_ids") is not None and not any(loop_mask(list(_answer(r))))]
    out["loop_free_answers"] = _answers_tau(free_answers, len(rows))
    out["finished"] = _answers_tau([r for r in rows if r.get("finished")], len(rows))
    if plain is not None:
        base = {rep: _pooled_tok_s([e2e_of(r) for r in rs]) for rep, rs in _by_rep(plain).items()}
        paired = [t / base[rep] for rep, t in e2e.items() if rep in base]
        out["e2e"]["speedup_median"] = statistics.median(e2e.values()) / statistics.median(base.values())
        out["e2e"]["speedup_paired"] = spread(paired) if paired else None
        pw = arm_figures(plain, None).get("stream_wall")
        if streamed and pw:
            out["stream_wall"]["speedup_median"] = out["stream_wall"]["tok_s"]["median"] / pw["tok_s"]["median"]
        pf = arm_figures(plain, None)["loop_free"]
        if pf["decode_tok_s"] and free.tok_s:
            out["loop_free"]["speedup_decode"] = free.tok_s / pf["decode_tok_s"]
        out["finished"]["speedup_e2e"] = _paired_speedup(rows, plain, lambda r: bool(r.get("finished")))
        out["loop_free_answers"]["speedup_e2e"] = _paired_speedup(rows, plain, lambda r: not any(loop_mask(_answer(r))))
    return out


def _answers_tau(kept: list[dict], of: int) -> dict:
    """How many answers were kept, and their tau: tokens after the prefill's over their verifies."""
    tokens = sum(int(r["new_tokens"]) - 1 for r in kept if r.get("verify_count"))
    return {"answers": len(kept), "of": of, "tau": _tau(tokens, sum(int(r.get("verify_count") or 0) for r in kept))}


def _by_rep(rows: list[dict]) -> dict[int, list[dict]]:
    by: dict[int, list[dict]] = {}
    for r in rows:
        by.setdefault(r["repetition"], []).append(r)
    return dict(sorted(by.items()))


def _prefill_tokens(rows: list[dict]) -> int:
    """The prefill's first token of each speculative answer: no verify emitted it."""
    return sum(1 for r in rows if r.get("verify_count"))


def _answer(r: dict) -> list[int]:
    """The answer a request's e2e time belongs to: the non-streamed one when there is one."""
    return list((r.get("whole") or r)["output_ids"] or [])


def _paired_speedup(rows: list[dict], plain: list[dict], keep) -> float | None:
    """e2e tok/s over the (prompt, repetition) pairs where both this arm's and the plain answer pass `keep`, over
    plain's on the same pairs."""
    both = {(r["prompt_index"], r["repetition"]): r for r in plain if keep(r)}
    keys = [(r, (r["prompt_index"], r["repetition"])) for r in rows if keep(r)]
    pairs = [(r, both[k]) for r, k in keys if k in both]
    if not pairs:
        return None
    return _pooled_tok_s([e2e_of(s) for s, _ in pairs]) / _pooled_tok_s([e2e_of(b) for _, b in pairs])


def _pooled_tok_s(pairs: list[tuple[int, float]]) -> float:
    secs = sum(s for _, s in pairs)
    return sum(n for n, _ in pairs) / secs if secs > 0 else 0.0


def spread(xs: list[float]) -> dict:
    """Median, min and max over the repetitions, and the values per repetition."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "per_repetition": xs}


def _timing(rows: list[dict]) -> str:
    if all(r.get("whole") for r in rows):
        return "non-streamed requests: wall time, prefill and transport included"
    if all(r.get("wall_s") is not None and r.get("events") for r in rows):
        return "streamed requests: wall time, prefill and transport included"
    return "prefill + decode"


def figures_of_runs(runs: list[dict]) -> dict:
    """Every arm's figures from a bench's raw runs (runs.jsonl rows of the first prompt set)."""
    pset = runs[0]["prompts"]
    runs = [r for r in runs if r["prompts"] == pset]
    plain = [r for r in runs if r["mode"] == "baseline"]
    out = {"baseline": arm_figures(plain, None)}
    for key in dict.fromkeys(r["setting"] for r in runs if r["mode"] == "speculative"):
        out[key] = arm_figures([r for r in runs if r["mode"] == "speculative" and r["setting"] == key], plain)
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse
    import gzip
    import json

    ap = argparse.ArgumentParser(prog="python -m eagle3ft.eval.bench.live_splits", description=__doc__.split("\n")[0])
    ap.add_argument("runs", help="a bench's runs.jsonl (or .jsonl.gz)")
    ap.add_argument("--cap", type=int, help="cut the streamed requests at this many new tokens (cut_at)")
    args = ap.parse_args(argv)
    with (gzip.open if args.runs.endswith(".gz") else open)(args.runs, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if args.cap is not None:
        if args.cap < 1:
            ap.error("--cap: at least 1 new token")
        try:
            rows = [cut_at(r, args.cap) for r in rows]
        except ValueError as e:
            ap.error(str(e))
    print(json_text(figures_of_runs(rows), "live splits", indent=1))


if __name__ == "__main__":
    main()
