"""A bench run's raw runs (RUN/bench/runs.jsonl, one row per request) as the eval jobs read them: the bench's
schedule for its same-prompt offline τ, and eval/offline/same_prompts.py for another run's answers."""

from __future__ import annotations


def first_answers(runs: list[dict], pset: str, setting: str | None = None) -> dict[int, list[int]]:
    """Prompt index -> output ids of the first repetition of prompt set `pset` in a bench's raw runs (runs.jsonl's
    rows): the plain pass's, or with `setting` (a key such as "3/1/4") the speculative pass's."""
    mode = "baseline" if setting is None else "speculative"
    return {
        r["prompt_index"]: r["output_ids"]
        for r in runs
        if r["mode"] == mode and r["setting"] == setting and r["repetition"] == 0 and r["prompts"] == pset
    }
