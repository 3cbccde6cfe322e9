"""The guard on what the drafter already knew (train.guard): validation splits drawn out of the training sources,
and the export chosen on them.

- `general_from`: a seeded draw of `general_samples` conversations of one training source (a replay of general
  conversations) is set aside, never trained on, and its τ is measured at the start and at every held-out
  evaluation. Being a part of the training sources, it shares no conversation with a held-out set (a replay with
  `exclude_heldout` shares no 8-gram with one), so no figure the verdict or the report prints chooses anything.
- `domain_from`: likewise a draw of the domain's training source, on which the evaluated steps are ranked; without
  it they are ranked on train.heldout's score (the held-out sets, best_on).

`choose`: the exported drafter is the best step on the domain among those whose general τ stays within
`general_bound` of the start's (the start is one of them: its own τ is the bound's reference). When no trained step
keeps the bound, or none beats the start on the domain, the start is exported, and the record says which and why.
RUN/train/guard.json holds every evaluation and the choice; RUN/export's card.json repeats the choice.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3ft.config_train import GuardConfig

GENERAL, DOMAIN = "general", "domain"  # the validation splits' names in the records


def draw(names: list[str | None], source: str, n: int, seed: int, key: str) -> list[int]:
    """The indices of a seeded draw of `n` samples of `source` (all of them when it holds fewer); ValueError naming
    the sources there are when it holds none."""
    of_source = [i for i, name in enumerate(names) if name == source]
    if not of_source:
        known = sorted({name for name in names if name is not None})
        raise ValueError(
            f"train.guard.{key} {source!r}: no training sample was harvested from that source "
            f"(training sources: {', '.join(known) or 'none recorded'})"
        )
    g = torch.Generator().manual_seed(seed * 6_151 + 49_157 + len(source))
    order = torch.randperm(len(of_source), generator=g).tolist()
    return sorted(of_source[i] for i in order[:n])


def validation_indices(gcfg: GuardConfig, names: list[str | None], seed: int) -> dict[str, list[int]]:
    """{general: indices, domain: indices} of the training samples set aside (empty when the guard is off)."""
    if gcfg.general_from is None:
        return {}
    if gcfg.domain_from == gcfg.general_from:
        raise ValueError(f"train.guard: general_from and domain_from are both {gcfg.general_from!r}")
    out = {GENERAL: draw(names, gcfg.general_from, gcfg.general_samples, seed, "general_from")}
    if gcfg.domain_from is not None:
        out[DOMAIN] = draw(names, gcfg.domain_from, gcfg.domain_samples, seed, "domain_from")
    left = len(names) - sum(len(v) for v in out.values())
    if left <= 0:
        raise ValueError("train.guard: the validation splits would take every training sample")
    return out


def choose(history: list[dict], bound: float) -> dict:
    """The step to export from `history` (each {step, general, domain}: general τ and the domain's score; the first
    is the start, step 0): the best on the domain among those with general >= (1 - bound) x the start's, the earlier
    on a tie (the start wins a tie). Returns the choice: its step, why, the bound and the floor."""
    start = history[0]
    floor = (1 - bound) * start[GENERAL]
    kept = [h for h in history if h[GENERAL] >= floor]
    best = max(kept, key=lambda h: h[DOMAIN])  # the first of equals: the earliest
    trained = history[1:]
    kept_trained = [h for h in kept if h is not start]
    base = {
        "step": best["step"],
        "general_tau": best[GENERAL],
        "domain_score": best[DOMAIN],
        "start_general_tau": start[GENERAL],
        "start_domain_score": start[DOMAIN],
        "bound": bound,
        "floor": floor,
        "steps_evaluated": [h["step"] for h in trained],
        "steps_within_bound": [h["step"] for h in kept_trained],
    }
    if best is not start:
        why = (
            f"step {best['step']}: the best on the domain ({best[DOMAIN]:.4f}, start {start[DOMAIN]:.4f}) among the "
            f"{len(kept_trained)} of {len(trained)} evaluated steps whose general τ stayed within {bound:.1%} of the "
            f"start's {start[GENERAL]:.4f} (floor {floor:.4f}; this step's {best[GENERAL]:.4f})"
        )
    elif not kept_trained:
        lowest = min(trained, key=lambda h: h[GENERAL]) if trained else None
        why = (
            "no step was evaluated after the start: the start is kept"
            if lowest is None
            else (
                f"no trained step kept the general τ within {bound:.1%} of the start's {start[GENERAL]:.4f} (floor "
                f"{floor:.4f}; the steps fell to as low as {lowest[GENERAL]:.4f} at step {lowest['step']}): the start is "
                "kept rather than ship a drafter that forgets"
            )
        )
    else:
        why = (
            f"the {len(kept_trained)} trained steps within {bound:.1%} of the start's general τ {start[GENERAL]:.4f} "
            f"gained nothing on the domain over the start's {start[DOMAIN]:.4f}: the start is kept"
        )
    return {**base, "kept_start": best is start, "why": why}


class Guard:
    """The evaluations' history (start first) and the choice, kept in RUN/train/guard.json by the main process."""

    def __init__(self, gcfg: GuardConfig, path: Path, resumed_step: int | None) -> None:
        self.bound, self.domain_from, self.path = gcfg.general_bound, gcfg.domain_from, path
        self.history: list[dict] = []
        if resumed_step is not None and path.is_file():
            saved = json.loads(path.read_text()).get("history", [])
            self.history = [h for h in saved if h["step"] <= resumed_step]
        if resumed_step and not self.history:
            raise ValueError(
                f"train.guard: resumed at step {resumed_step} without the start's general τ ({path} holds none): "
                "start over with --overwrite, or set train.guard.general_from null"
            )

    @property
    def choice(self) -> dict | None:
        return choose(self.history, self.bound) if self.history else None

    @property
    def needs_start(self) -> bool:
        return not self.history

    def observe(self, step: int, general: float, domain: float) -> dict:
        """Add one evaluation; the choice over every evaluation so far."""
        self.history = [h for h in self.history if h["step"] != step] + [
            {"step": step, GENERAL: general, DOMAIN: domain}
        ]
        return choose(self.history, self.bound)

    def write(self, choice: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"bound": self.bound, "domain_from": self.domain_from, "history": self.history, "choice": choice}
        self.path.write_text(json.dumps(record, indent=1) + "\n")
