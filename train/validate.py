"""Held-out τ while training: the greedy chain accept length of the drafter on a fixed held-out set.

The TTT unroll run under no_grad already counts, per depth k, the positions where every earlier draft
matched the target's argmax (chain_valid) and those where depth k matched too (chain_correct). Summed
over the whole set and over ranks before any ratio, a_k = chain_correct_k / chain_valid_k is the
conditional acceptance at depth k and τ = 1 + Σ_k Π_{j≤k} a_j, with the leading 1 the bonus token.

One mask change makes this count the same roots as eval/offline/accept_len.py's chain: a root (the token the
target has just emitted) must itself be a response token. `heldout_view` therefore keeps a predicted
token only when the token before it is a response token too. On the target's own greedy answers
(regenerated data, stored token = target argmax), the result then equals accept_len's greedy chain τ
at the same depth (a test checks it on the tiny model).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from eagle3ft.config import Config, EvalConfig
from eagle3ft.config_train import TrainConfig
from eagle3ft.data.store import FeatureStore, collate
from eagle3ft.drafter.folder import DrafterFolder
from eagle3ft.files import write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.train.dist import Dist
from eagle3ft.train.guard import DOMAIN, GENERAL, Guard


@dataclass
class HeldoutTau:
    """Held-out chain counts summed over the set (and ranks), and what they give."""

    step: int
    heldout_tau: float
    heldout_cond_acc: list[float]  # a_k, k = 1..depth
    heldout_tokens: int  # answer tokens (loss_mask) in the held-out set
    chain_correct: list[float]
    chain_valid: list[float]

    def record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("chain_correct", "chain_valid")}


def tau_from_counts(chain_correct: list[float], chain_valid: list[float]) -> tuple[float, list[float]]:
    """(τ, a_k) from summed chain counts: a_k = correct_k / valid_k, τ = 1 + Σ_k Π_{j≤k} a_j."""
    cond = [c / v if v > 0 else 0.0 for c, v in zip(chain_correct, chain_valid)]
    return 1.0 + sum(math.prod(cond[: k + 1]) for k in range(len(cond))), cond


def heldout_view(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch with loss_mask[t] kept only where loss_mask[t-1] is set too: the root of every counted chain
    (the token before the first drafted one) is a response token, as in eval/offline/accept_len.py."""
    lm = batch["loss_mask"]  # (B, T)
    prev = torch.cat([torch.zeros_like(lm[:, :1]), lm[:, :-1]], dim=1)
    return {**batch, "loss_mask": lm * prev}


def heldout_batches(ds, n: int, rank: int, world: int, micro_batch_size: int, max_len: int | None) -> list[dict]:
    """This rank's collated batches of the first n held-out items (items rank, rank+world, ...).

    Every rank gets the same number of batches, so sharded engines (ZeRO-3) run the same forwards on each;
    a rank short of items repeats one with its loss_mask zeroed (it counts nothing).
    """
    n = min(n, len(ds))
    per_rank = math.ceil(n / world) if n else 0
    mine = [ds[i] for i in range(rank, n, world)]
    if n and len(mine) < per_rank:
        filler = {k: (torch.zeros_like(v) if k == "loss_mask" else v) for k, v in ds[0].items()}
        mine += [filler] * (per_rank - len(mine))
    return [collate(mine[a : a + micro_batch_size], max_len=max_len) for a in range(0, len(mine), micro_batch_size)]


@torch.no_grad()
def heldout_tau(
    forward: Callable[[dict], object],
    batches: Iterable[dict],
    depth: int,
    step: int = 0,
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
    device: torch.device | str = "cpu",
    features: Callable[[dict], dict] | None = None,
) -> HeldoutTau:
    """Held-out greedy chain τ at `depth`.

    forward(batch) runs the TTT unroll (TTTObjective's forward, or the engine wrapping it) for at least
    `depth` steps and returns its TTTOutput; reduce_sum sums a tensor over ranks; features(batch) adds the
    target's features to a token batch (online training).
    """
    counts = torch.zeros(3, depth, dtype=torch.float64, device=device)  # chain_correct, chain_valid, tokens (col 0)
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items() if k != "sample_id"}
        if features is not None:
            batch = features(batch)
        out = forward(heldout_view(batch))
        if out.chain_valid.shape[0] < depth:
            raise ValueError(
                f"held-out τ at depth {depth} needs an unroll of at least {depth} steps, got {out.chain_valid.shape[0]}"
            )
        counts[0] += out.chain_correct[:depth].double()
        counts[1] += out.chain_valid[:depth].double()
        counts[2, 0] += batch["loss_mask"].sum()
    counts = reduce_sum(counts)
    correct, valid = counts[0].tolist(), counts[1].tolist()
    tau, cond = tau_from_counts(correct, valid)
    return HeldoutTau(step, tau, cond, int(counts[2, 0]), correct, valid)


# --------------------------------------------------------------------------- best checkpoint


CARD = "card.json"


def read_card(folder: Path) -> dict | None:
    """The card an export folder carries (which step, its held-out τ), or None."""
    p = Path(folder) / CARD
    return json.loads(p.read_text()) if p.is_file() else None


def write_card(
    folder: Path,
    which: str,
    step: int,
    result: HeldoutTau | None,
    depth: int,
    sets: dict | None = None,
    block: bool = False,
):
    """card.json beside config.json: which export this is ("last" or "best"), its step and held-out τ, and with
    `sets` (HeldoutTracker.latest_sets) the τ of each held-out set and the score the best export is chosen on. A
    DFlash drafter's (`block`) τ is its live chain walk; beside it the requests' spec_accept_length form, answer
    tokens / cycles (each answer's tokens are its cycles' commits)."""
    card = {"which": which, "step": step, "heldout_depth": depth}
    if block:
        card["heldout_kind"] = "dflash chain walk"
        if result is not None and result.chain_valid and result.chain_valid[0]:
            card["heldout_spec_accept_length"] = result.heldout_tokens / result.chain_valid[0]
    if result is not None:
        card.update(
            {
                "heldout_step": result.step,
                "heldout_tau": result.heldout_tau,
                "heldout_cond_acc": result.heldout_cond_acc,
                "heldout_tokens": result.heldout_tokens,
            }
        )
    card.update(sets or {})
    write_json(Path(folder) / CARD, card, indent=2, newline=True)


def group_by_source(names: list[str | None], n: int) -> dict[str, list[int]]:
    """The first `n` indices of each held-out set, the sets by source name in order of first appearance; samples of
    no recorded source form one set, "heldout"."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        group = groups.setdefault(name or "heldout", [])
        if len(group) < n:
            group.append(i)
    return groups


class Subset:
    """The items of `ds` at `idx`, as a dataset (heldout_batches reads len and [i])."""

    def __init__(self, ds, idx: list[int]) -> None:
        self.ds, self.idx = ds, idx

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, i: int):
        return self.ds[self.idx[i]]


class HeldoutTracker:
    """The training loop's held-out τ: every `train.eval_every` steps and at the end, on the first
    `train.eval_samples` samples of each held-out set (the sources the harvest recorded), at the eval setting's
    depth (`eval.steps`); τ per set, and over every set (their counts summed). The best step is exported to
    RUN/export-best/ (RUN/export/ stays the last, the one SGLang is pointed at): best by the mean τ of the sets that
    `train.best_on` names, weighted as it says, else by the τ over every set.

    `evaluate` and `keep_if_best` are collective: every rank calls them (the counts are summed over ranks,
    and a sharded engine gathers the weights on all of them).
    """

    def __init__(
        self,
        run_dir: Path,
        heldout: tuple,
        train: TrainConfig,
        ev: EvalConfig,
        dist: Dist,
        resumed: bool,
        depth: int | None = None,
        validation: dict | None = None,
        resumed_step: int | None = None,
    ) -> None:
        """heldout: (items, where, features, each item's source name) as train/data.py's TrainData.heldout gives
        them. depth: the chain's length (default eval.steps; a DFlash drafter's block drafts B - 1). validation:
        train.guard's splits (TrainData.validation), which choose RUN/export-best and RUN/export (train/guard.py)."""
        tcfg = train
        self.block = depth is not None  # a DFlash drafter's walk over blocks
        self.dist, self.depth, self.every, self.best_on = (
            dist,
            depth or ev.steps,
            tcfg.heldout.eval_every,
            tcfg.heldout.best_on,
        )
        self.best_dir = RunDir(run_dir).export_best
        ds, where, self.features, names = heldout
        groups = group_by_source(names, tcfg.heldout.eval_samples)
        unknown = sorted(set(self.best_on) - set(groups))
        if unknown:
            raise ValueError(
                f"train.best_on names {', '.join(unknown)}, which {where} holds no held-out sample of "
                f"(held-out sets: {', '.join(groups) or 'none'})"
            )
        self.sets = {
            name: heldout_batches(
                Subset(ds, idx), len(idx), dist.rank, dist.world, tcfg.batch.micro_batch_size, tcfg.batch.max_len
            )
            for name, idx in groups.items()
        }
        self.guard_sets = {
            name: heldout_batches(ds, len(ds), dist.rank, dist.world, tcfg.batch.micro_batch_size, tcfg.batch.max_len)
            for name, ds in (validation or {}).items()
        }
        self.guard = (
            Guard(tcfg.guard, RunDir(run_dir).metrics.parent / "guard.json", resumed_step if resumed else None)
            if self.guard_sets
            else None
        )
        self.choice = self.guard.choice if self.guard is not None else None  # the guard's latest choice
        self.enabled = any(self.sets.values()) or self.guard is not None
        card = read_card(self.best_dir) if resumed else None
        self.best_score = (card.get("heldout_score", card.get("heldout_tau")) if card else None) or -math.inf
        self.latest: HeldoutTau | None = None
        self.latest_sets: dict = {}  # the sets' τ and the score of the latest evaluation (the cards' fields)
        if not resumed and dist.is_main and self.best_dir.exists():
            import shutil

            shutil.rmtree(self.best_dir)  # a previous run's best; this run starts over
        if not self.enabled:
            dist.print(f"held-out τ: {where} has no held-out samples; no held-out τ and no export-best")

    def due(self, step: int, total: int) -> bool:
        return self.enabled and (step >= total or (self.every > 0 and step % self.every == 0))

    def _tau(self, engine, batches, step: int) -> HeldoutTau:
        return heldout_tau(
            lambda b: engine(b, steps=self.depth),
            batches,
            self.depth,
            step,
            self.dist.reduce_sum,
            self.dist.device,
            self.features,
        )

    def evaluate(self, engine, step: int) -> HeldoutTau:
        """τ of each held-out set and over all of them (`latest`, `latest_sets`); with the guard, τ of its
        validation splits and its choice (`choice`)."""
        per_set = {name: self._tau(engine, batches, step) for name, batches in self.sets.items()}
        correct = [sum(r.chain_correct[k] for r in per_set.values()) for k in range(self.depth)]
        valid = [sum(r.chain_valid[k] for r in per_set.values()) for k in range(self.depth)]
        tau, cond = tau_from_counts(correct, valid)
        self.latest = HeldoutTau(step, tau, cond, sum(r.heldout_tokens for r in per_set.values()), correct, valid)
        sets = {name: {"tau": r.heldout_tau, "tokens": r.heldout_tokens} for name, r in per_set.items()}
        if self.best_on:
            weights = sum(self.best_on.values())
            score = sum(w * sets[name]["tau"] for name, w in self.best_on.items()) / weights
        else:
            score = tau
        self.latest_sets = {"heldout_sets": sets, "heldout_score": score, "best_on": dict(self.best_on)}
        if self.guard is not None:
            guard = {name: self._tau(engine, b, step).heldout_tau for name, b in self.guard_sets.items()}
            domain = guard.get(DOMAIN, score)
            self.choice = self.guard.observe(step, guard[GENERAL], domain)
            if self.dist.is_main:
                self.guard.write(self.choice)
            self.latest_sets["guard_sets"] = guard
        return self.latest

    def keep_if_best(self, engine, drafter_config, result: HeldoutTau) -> bool:
        """Export the current weights to RUN/export-best when the latest score beats every earlier one."""
        from eagle3ft.drafter.export import atomic_dir
        from eagle3ft.drafter.folder import write_folder

        score = self.latest_sets["heldout_score"]
        if self.guard is not None:  # the guard's choice, not the held-out score, picks the best
            if self.choice["step"] != result.step:
                return False
            self.latest_sets["guard"] = self.choice
        elif not score > self.best_score:
            return False
        self.best_score = score
        state = self.dist.full_state_dict(engine)
        if self.dist.is_main:
            with atomic_dir(self.best_dir) as tmp:
                write_folder(tmp, drafter_config, state, prefix="drafter.")
                write_card(tmp, "best", result.step, result, self.depth, self.latest_sets, self.block)
        self.dist.barrier()
        return True

    def run(self, engine, drafter_config, step: int) -> dict:
        """Evaluate, keep the best; the fields for this step's metrics record."""
        result = self.evaluate(engine, step)
        best = self.keep_if_best(engine, drafter_config, result)
        return {
            **result.record(),
            "heldout_depth": self.depth,
            "heldout_sets": self.latest_sets["heldout_sets"],
            "heldout_score": self.latest_sets["heldout_score"],
            "heldout_best": best,
            "heldout_best_score": self.best_score,
            **(
                {"guard_sets": self.latest_sets["guard_sets"], "guard_choice": self.choice["step"]}
                if self.guard is not None
                else {}
            ),
        }


# --------------------------------------------------------------------------- standalone


def run(cfg: Config, run_dir: Path, checkpoint: str | None = None) -> HeldoutTau:
    """Held-out τ of an exported drafter (default eval.checkpoint) as training computes it, on one device;
    writes RUN/eval/heldout_tau.json. Its counts are eval/offline/accept_len.py's greedy chain counts on greedy data."""
    from eagle3ft.targets.hf import load_input_embedding, pick_device
    from eagle3ft.train.ttt import TTTObjective

    tcfg, depth = cfg.train, cfg.eval.steps
    folder = DrafterFolder.of_run(run_dir, checkpoint or cfg.eval.checkpoint, "checkpoint")
    store = FeatureStore(RunDir(run_dir).features)
    store.check_drafter(folder)  # before any compute
    device = pick_device(cfg.target)
    ckpt = folder.path
    if folder.family == "dflash":  # the live chain walk over blocks, as training's held-out τ
        from eagle3ft.targets.hf import load_output_head
        from eagle3ft.train.dflash_objective import DFlashObjective

        drafter = folder.load().to(device).eval()
        depth = drafter.config.block_size - 1
        objective = DFlashObjective(drafter, load_input_embedding(cfg.target), load_output_head(cfg.target))
        objective = objective.to(device)
    else:
        drafter = folder.load(load_input_embedding(cfg.target)).to(device).eval()
        objective = TTTObjective(drafter, depth, tcfg.objective.step_decay)
    ds = store.dataset("heldout")
    n = len(ds) if cfg.eval.max_samples is None else min(len(ds), cfg.eval.max_samples)
    result = heldout_tau(
        lambda b: objective(b, steps=depth),
        heldout_batches(ds, n, 0, 1, tcfg.batch.micro_batch_size, tcfg.batch.max_len),
        depth,
        device=device,
    )
    out = RunDir(run_dir).eval
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "heldout_tau.json", {**asdict(result), "depth": depth, "checkpoint": str(ckpt)}, 2, newline=True)
    return result


def main(argv: list[str] | None = None) -> None:
    from eagle3ft.cli import build_parser, cli_errors, error_log, parse_cli
    from eagle3ft.data.store import StoreError

    ap = build_parser("Held-out greedy chain tau of an exported drafter through the TTT unroll (as training logs it).")
    ap.add_argument("--checkpoint", help="drafter folder, relative to the run folder (default eval.checkpoint)")
    cfg, run_dir, args = parse_cli("", stage="heldout_tau", argv=argv, parser=ap)
    with cli_errors("validate", StoreError, log=error_log(run_dir, "heldout_tau")):
        r = run(cfg, run_dir, args.checkpoint)
    print(
        f"held-out tau {r.heldout_tau:.4f} at depth {cfg.eval.steps} over {r.heldout_tokens} answer tokens; "
        f"a_k {[round(a, 4) for a in r.heldout_cond_acc]}"
    )


if __name__ == "__main__":
    main()
