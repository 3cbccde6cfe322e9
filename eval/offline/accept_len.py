"""Offline accept length (tau) of a drafter on held-out target features.

eval/offline/acceptance.py gives, per sample, an acceptance alpha for every root and depth (chain and tree).
Expected counts over the whole set, then ratios: reach_k = prod_{j<k} alpha_j,
  attempts_k = sum reach_k,  accepts_k = sum reach_k * alpha_k,  a_k = accepts_k / attempts_k,
  tau = 1 + sum_k prod_{j<=k} a_j   (the 1 is the bonus token, as in SGLang's spec_accept_length).
acc_k = sum alpha_k / (#depth-k chains) is the unconditional rate: NOT tau.
Beside each greedy setting's tau over every root, tau_walk: the tokens per cycle of a live greedy decoder that walks
the same answers cycle by cycle (eval/offline/acceptance.py, cycle_walk). Published tables quote the first; a live bench
measures the second. tau_walk_interval: its 90% interval over the samples drawn again (walk_interval), how far tau
moves on another draw of as many prompts.

`python eval/offline/accept_len.py --config CFG --run-dir RUN` writes RUN/eval/accept_len.json.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle3ft.cli import cli_errors, command_name, error_log, parse_cli
from eagle3ft.config import Config, EvalConfig, HarvestConfig, TargetConfig
from eagle3ft.data.loops import answer_loops as loop_of_answers
from eagle3ft.data.store import FeatureStore, StoreError
from eagle3ft.drafter.folder import DrafterFolder
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.eval.offline.acceptance import (
    SampleInputs,
    chain_accept_lengths,
    chain_acceptance,
    cycle_walk_rows,
    tree_accept,
)
from eagle3ft.eval.offline.dflash_accept import dflash_report, format_dflash
from eagle3ft.eval.preflight import check_or_exit
from eagle3ft.files import write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.runlock import holding

# --------------------------------------------------------------------------- counts -> tau


@dataclass
class ChainCounts:
    """Expected counts per depth (index k-1 for depth k), summed over every root of the set."""

    attempts: list[float]
    accepts: list[float]
    chains: list[int]  # chains where depth k exists (for the unconditional rate)
    alpha_sum: list[float]  # sum of alpha_k over those chains

    @classmethod
    def zeros(cls, depth: int) -> "ChainCounts":
        return cls([0.0] * depth, [0.0] * depth, [0] * depth, [0.0] * depth)

    @classmethod
    def from_alpha(cls, alpha: torch.Tensor, valid: torch.Tensor) -> "ChainCounts":
        """alpha float (N, K) acceptance per root and depth; valid bool (N, K), a prefix per row."""
        alpha = alpha.double() * valid
        reach = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), alpha[:, :-1]], dim=1), dim=1)
        reach = reach * valid
        return cls(
            attempts=reach.sum(0).tolist(),
            accepts=(reach * alpha).sum(0).tolist(),
            chains=valid.sum(0).tolist(),
            alpha_sum=alpha.sum(0).tolist(),
        )

    def __add__(self, o: "ChainCounts") -> "ChainCounts":
        return ChainCounts(*[[a + b for a, b in zip(x, y)] for x, y in zip(astuple4(self), astuple4(o))])

    @property
    def depth(self) -> int:
        return len(self.attempts)

    def conditional(self) -> list[float]:
        """a_k, the acceptance at depth k given every earlier depth was accepted."""
        return [acc / att if att > 0 else 0.0 for acc, att in zip(self.accepts, self.attempts)]

    def unconditional(self) -> list[float]:
        return [s / n if n else 0.0 for s, n in zip(self.alpha_sum, self.chains)]

    def tau(self, depth: int | None = None) -> float:
        """1 + sum_{k<=depth} prod_{j<=k} a_j."""
        tau, run = 1.0, 1.0
        for a in self.conditional()[: depth or self.depth]:
            run *= a
            tau += run
        return tau

    def table(self) -> list[dict]:
        rows, run = [], 1.0
        for k, (a, u) in enumerate(zip(self.conditional(), self.unconditional()), start=1):
            run *= a
            rows.append(
                {
                    "depth": k,
                    "attempts": self.attempts[k - 1],
                    "accepts": self.accepts[k - 1],
                    "a_k": a,
                    "reach_prob": run,
                    "acc_k_unconditional": u,
                    "chains": self.chains[k - 1],
                }
            )
        return rows


def astuple4(c: ChainCounts) -> tuple:
    return (c.attempts, c.accepts, c.chains, c.alpha_sum)


# --------------------------------------------------------------------------- the whole set


@dataclass
class AcceptReport:
    steps: int
    topk: int
    num_draft_tokens: int
    temperature: float  # of the sampled estimate
    samples: int
    roots: int
    greedy: dict = field(default_factory=dict)  # tau + per-depth table
    sampled: dict = field(default_factory=dict)
    tree: dict | None = None
    settings: dict = field(default_factory=dict)  # "steps/topk/draft" -> {"tau", "kind"}
    headline_tau: float = 0.0
    headline: str = "greedy"
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate(
    drafter: Eagle3Drafter,
    samples,
    steps: int,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    temperature: float = 0.0,
    device="cpu",
    tree_context: str = "slots",
) -> AcceptReport:
    """Offline tau over an iterable of store items (dicts as FeatureStore.dataset yields); tree_context as
    eval/offline/acceptance.py's tree_accept."""
    t0 = time.perf_counter()
    num_draft_tokens = num_draft_tokens or steps + 1
    samp_t = temperature if temperature > 0 else 1.0
    g, sm = ChainCounts.zeros(steps), ChainCounts.zeros(steps)
    tree_sum, tree_n, n_samples, n_roots = 0, 0, 0, 0
    walk = {d: [] for d in range(1, steps + 1)}  # depth -> (tokens, cycles) of the greedy cycle walk, per sample
    tree_walk = []
    for item in samples:
        s = SampleInputs.of(item, device)
        if s.input_ids.shape[0] < 2:
            continue
        res = chain_acceptance(drafter, s, steps, samp_t)
        g = g + ChainCounts.from_alpha(res.greedy_alpha, res.greedy_valid)
        sm = sm + ChainCounts.from_alpha(res.sampled_alpha, res.sampled_valid)
        loops = answer_loops(s)
        for d, per_sample in walk.items():
            per_sample.append(_totals(cycle_walk_rows(*chain_accept_lengths(res, d)), loops))
        if topk > 1:
            acc, is_root, complete = tree_accept(drafter, s, steps, topk, num_draft_tokens, tree_context)
            tree_sum += int(acc[complete].sum())
            tree_n += int(complete.sum())
            tree_walk.append(_totals(cycle_walk_rows(acc, is_root), loops))
        n_samples += 1
        n_roots += int(res.greedy_valid[:, 0].sum())
    rep = AcceptReport(steps, topk, num_draft_tokens, samp_t, n_samples, n_roots)
    rep.greedy = {"tau": g.tau(), "per_depth": g.table()}
    rep.sampled = {"tau": sm.tau(), "temperature": samp_t, "per_depth": sm.table()}
    chain = g if temperature == 0 else sm
    for d in range(1, steps + 1):
        rep.settings[f"{d}/1/{d + 1}"] = {"tau": chain.tau(d), "kind": "chain"}
        if temperature == 0:  # the walk follows the greedy path only
            rep.settings[f"{d}/1/{d + 1}"].update(_walk_fields(walk[d]))
    if topk > 1:
        tau_tree = 1.0 * tree_sum / tree_n if tree_n else 0.0
        rep.tree = {
            "tau": tau_tree,
            "roots": tree_n,
            "acceptance": "greedy",
            "context": tree_context,
            "tau_walk": _walk_tau(tree_walk),
        }
        rep.settings[f"{steps}/{topk}/{num_draft_tokens}"] = {
            "tau": tau_tree,
            "kind": "tree (greedy)",
            **_walk_fields(tree_walk),
        }
        rep.headline_tau, rep.headline = tau_tree, "tree (greedy)"
    else:
        rep.headline_tau = chain.tau()
        rep.headline = "chain greedy" if temperature == 0 else f"chain sampled T={samp_t:g}"
    rep.seconds = time.perf_counter() - t0
    return rep


def walk_totals(drafter: Eagle3Drafter, item: dict, steps: int, device="cpu") -> tuple[int, int, float, float]:
    """One sample's greedy cycle walk at steps/1/steps+1, as `evaluate` counts it: (tokens, cycles, loop-free tokens,
    loop-free cycles)."""
    s = SampleInputs.of(item, device)
    if s.input_ids.shape[0] < 2:
        return 0, 0, 0.0, 0.0
    res = chain_acceptance(drafter, s, steps)
    return _totals(cycle_walk_rows(*chain_accept_lengths(res, steps)), answer_loops(s))


def answer_loops(s: SampleInputs) -> list[bool]:
    """Per position: whether the token sits in a repetition loop of its own answer turn (data/loops.py)."""
    return loop_of_answers(s.input_ids.tolist(), s.loss_mask.tolist())


def _totals(cycles: list[tuple[int, int]], loops: list[bool]) -> tuple[int, int, float, float]:
    """One sample's cycle walk -> (tokens, cycles, loop-free tokens, loop-free cycles): a cycle's share of loop-free
    tokens counts that share of the cycle."""
    free_tokens = free_cycles = 0.0
    for row, n in cycles:
        free = n - sum(loops[row + 2 : row + 2 + n])
        free_tokens += free
        free_cycles += free / n
    return sum(n for _, n in cycles), len(cycles), free_tokens, free_cycles


def _walk_tau(per_sample: list[tuple]) -> float | None:
    cycles = sum(x[1] for x in per_sample)
    return sum(x[0] for x in per_sample) / cycles if cycles else None


def _walk_fields(per_sample: list[tuple]) -> dict:
    free_cycles = sum(x[3] for x in per_sample)
    tokens = sum(x[0] for x in per_sample)
    return {
        "tau_walk": _walk_tau(per_sample),
        "cycles_walk": sum(x[1] for x in per_sample),
        "tau_walk_interval": walk_interval([x[:2] for x in per_sample]),
        "tau_walk_loop_free": sum(x[2] for x in per_sample) / free_cycles if free_cycles else None,
        "loop_share_walk": 1 - sum(x[2] for x in per_sample) / tokens if tokens else None,
    }


def walk_interval(
    per_sample: list[tuple[int, int]], level: float = 0.9, resamples: int = 1000, seed: int = 0
) -> list[float] | None:
    """The `level` interval of the walk's tau over the samples drawn again with replacement (a bootstrap): how far
    the same drafter's tau moves on another draw of as many prompts and answers. A live bench whose answers part
    from these (bf16 numerics at near-ties) decodes partly other answers: a scale of how far its tau may move, not a
    bound."""
    if len(per_sample) < 2:
        return None
    t = torch.tensor(per_sample, dtype=torch.float64)  # (n, 2): tokens, cycles
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(per_sample), (resamples, len(per_sample)), generator=g)  # (resamples, n)
    draws = t[idx].sum(1)  # (resamples, 2)
    taus = draws[:, 0] / draws[:, 1].clamp_min(1)
    lo, hi = torch.quantile(taus, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return [lo, hi]


def format_report(rep: AcceptReport) -> str:
    lines = [
        f"offline accept length over {rep.samples} samples, {rep.roots} roots: tau = {rep.headline_tau:.3f} "
        f"({rep.headline})"
    ]
    lines.append(f"{'depth':>5} {'a_k greedy':>10} {'a_k sampled':>11} {'acc_k uncond':>12} {'chains':>7}")
    for gr, sr in zip(rep.greedy["per_depth"], rep.sampled["per_depth"]):
        lines.append(
            f"{gr['depth']:>5} {gr['a_k']:>10.3f} {sr['a_k']:>11.3f} {gr['acc_k_unconditional']:>12.3f} "
            f"{gr['chains']:>7}"
        )
    lines.append(
        f"tau chain greedy {rep.greedy['tau']:.3f}; sampled (T={rep.sampled['temperature']:g}) {rep.sampled['tau']:.3f}"
    )
    walks = [f"{k} {v['tau_walk']:.3f}" for k, v in rep.settings.items() if v.get("tau_walk")]
    if walks:
        lines.append("tau of the live cycle walk (cycles start where the last ended): " + ", ".join(walks))
    if rep.tree:
        lines.append(
            f"tau tree {rep.steps}/{rep.topk}/{rep.num_draft_tokens} (greedy) {rep.tree['tau']:.3f} over "
            f"{rep.tree['roots']} roots ({rep.tree['context']}: what a frontier node attends to, eval.tree_context)"
        )
    return "\n".join(lines)


def run(cfg: Config, run_dir: Path) -> AcceptReport:
    """Load the exported drafter and the held-out features of `run_dir`, evaluate, write eval/accept_len.json."""
    from eagle3ft.targets.hf import load_input_embedding, pick_device  # transformers: off the --help path

    ec = cfg.eval
    folder = DrafterFolder.of_run(run_dir, ec.checkpoint)
    store = FeatureStore(RunDir(run_dir).features)
    store.check_drafter(folder)  # before any compute
    device = pick_device(cfg.target)
    if folder.family == "dflash":
        return run_dflash(cfg.eval, cfg.target, cfg.harvest, run_dir, folder, store, device)
    drafter = folder.load(load_input_embedding(cfg.target)).to(device).eval()
    ds = store.dataset("heldout")
    n = len(ds) if ec.max_samples is None else min(len(ds), ec.max_samples)
    items = (ds[i] for i in range(n))
    rep = evaluate(drafter, items, ec.steps, ec.topk, ec.num_draft_tokens, ec.temperature, device, ec.tree_context)
    out = RunDir(run_dir).accept_len
    out.parent.mkdir(parents=True, exist_ok=True)
    held_out = [
        asdict(s) for s in cfg.harvest.sources if s.split in ("heldout", "auto")
    ]  # where the held-out split came from
    data = {
        "features": str(RunDir(run_dir).features),
        "split": "heldout",
        "samples_in_split": len(ds),
        "sources": held_out,
        "heldout_fraction": cfg.harvest.heldout_fraction,
    }
    write_json(out, {**rep.to_dict(), "checkpoint": str(folder.path), "data": data}, indent=2)
    return rep


def heldout_data(harvest: HarvestConfig, run_dir: Path, samples_in_split: int) -> dict:
    """Where the held-out split came from (accept_len.json's data)."""
    return {
        "features": str(RunDir(run_dir).features),
        "split": "heldout",
        "samples_in_split": samples_in_split,
        "sources": [asdict(s) for s in harvest.sources if s.split in ("heldout", "auto")],
        "heldout_fraction": harvest.heldout_fraction,
    }


def run_dflash(
    ev: EvalConfig,
    target: TargetConfig,
    harvest: HarvestConfig,
    run_dir: Path,
    folder: DrafterFolder,
    store: FeatureStore,
    device: torch.device,
) -> dict:
    """A DFlash drafter's offline τ (eval/offline/dflash_accept.py): the live chain walk over the held-out answers,
    written to eval/accept_len.json in the same form."""
    from eagle3ft.targets.hf import load_input_embedding, load_output_head  # transformers: off the --help path

    ec = ev
    drafter = folder.load().to(device).eval()
    ds = store.dataset("heldout")
    n = len(ds) if ec.max_samples is None else min(len(ds), ec.max_samples)
    embed, head = load_input_embedding(target), load_output_head(target)
    rep, per_sample = dflash_report(drafter, (ds[i] for i in range(n)), embed, head, device)
    for setting in rep["settings"].values():
        setting["tau_walk_interval"] = walk_interval(per_sample)
    rep.update(checkpoint=str(folder.path), data=heldout_data(harvest, run_dir, len(ds)))
    out = RunDir(run_dir).accept_len
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, rep, indent=2)
    return rep


def main(argv: list[str] | None = None) -> None:
    prog = command_name("accept_len.py")  # in errors: the command the user typed

    cfg, run_dir, args = parse_cli(
        "Offline accept length of the drafter on held-out features.", stage="eval", argv=argv
    )
    check_or_exit(prog, "eval", cfg, run_dir, args.config)

    with (
        holding(run_dir, "eval", prog),
        cli_errors(prog, StoreError, log=error_log(run_dir, "eval")),
    ):
        rep = run(cfg, run_dir)
        if isinstance(rep, dict):  # a DFlash drafter's report
            print(format_dflash(rep))
        else:
            print(format_report(rep))


if __name__ == "__main__":
    main()
