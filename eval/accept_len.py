"""Offline accept length (tau) of a drafter on held-out target features.

Terms. A *root* is a response token the target has just emitted (position r); the drafter then
proposes tokens for positions r+1 .. r+K (depth 1..K). Drafter cache entry t holds the fused aux
features of token t and the embedding of token t+1, so root r reads entry r-1 first.

Chain (topk 1). The unroll is the live chain computation batched over every root at once: depth
k+1 feeds the ground-truth token r+k and the drafter's own pre-norm output of depth k, at position
id r-1+k, attending to the causal prefix (entries <= r-1) and to its own earlier depths. While all
earlier drafts were accepted the ground-truth token *is* the drafted token, so depth k is exactly
the chain conditional on acceptance so far (positions and attention as SGLang's draft loop, which
is why this uses Eagle3Drafter.step rather than the training unroll).
Per root and depth an acceptance alpha in [0, 1]:
  greedy:  1 if the drafted argmax (mapped through d2t) == the target's argmax (stored top-1);
  sampled: E_{x~q}[min(1, p(x)/q(x))] = sum_x min(p(x), q(x)), q the draft distribution at the
           temperature, p the target's at the same temperature from the stored top-k, renormalised.
           Approximations: target mass outside the stored top-k is dropped (alpha is biased up by at
           most that mass); deeper depths are conditioned on the stored token, not on a sampled one.
Expected counts over the whole set, then ratios: reach_k = prod_{j<k} alpha_j,
  attempts_k = sum reach_k,  accepts_k = sum reach_k * alpha_k,  a_k = accepts_k / attempts_k,
  tau = 1 + sum_k prod_{j<=k} a_j   (the 1 is the bonus token, as in SGLang's spec_accept_length).
A depth counts only where the token exists and is a response token (loss_mask), and, for greedy,
where every earlier stored token equals the target's argmax (else the target's greedy path is
not in the data). acc_k = sum alpha_k / (#depth-k chains) is the unconditional rate: NOT tau.

Tree (topk > 1, greedy): SGLang's tree is built by running the drafter on its own proposals: depth
1 takes the topk tokens of the root's distribution; each later depth expands topk children of each
of the topk best frontier nodes and keeps the topk best by cumulative draft probability as the next
frontier; finally the best num_draft_tokens-1 of all expanded nodes form the tree. Accepted = the
longest root path whose tokens all equal the target's greedy tokens (known offline where the stored
tokens are the greedy ones), plus the bonus. tau = mean over roots with every depth available.

`python eval/accept_len.py --config CFG --run-dir RUN` writes RUN/eval/accept_len.json.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3ft.train.model import DraftCache, Eagle3Drafter

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


# --------------------------------------------------------------------------- drafter unroll


def _node_step(drafter: Eagle3Drafter, cache: DraftCache, n_prefix: int, tokens, hidden, roots, anc, depth: int):
    """One drafter forward for N nodes of depth `depth` >= 1 sharing one causal prefix in `cache`.

    tokens (N,) target ids, hidden (N, H), roots (N,) the prefix entry each node hangs from
    (entry r-1 for root r), anc (N, depth-1) cache entries of the node's ancestors.
    Returns hidden_out (N, H), logits (N, Vd), the nodes' cache entries (N,).
    """
    past, N = cache.length, tokens.shape[0]
    dev = tokens.device
    mask = torch.zeros(N, past + N, dtype=torch.bool, device=dev)
    mask[:, :n_prefix] = torch.arange(n_prefix, device=dev)[None] <= roots[:, None]
    if anc.shape[1]:
        mask.scatter_(1, anc, True)
    entries = past + torch.arange(N, device=dev)
    mask[torch.arange(N, device=dev), entries] = True
    h, lg = drafter.step(tokens[None], hidden[None], (roots + depth)[None], cache, attn_mask=mask[None, None])
    return h[0], lg[0], entries


def _prefill(drafter: Eagle3Drafter, input_ids: torch.Tensor, aux_hidden: torch.Tensor):
    """Entries 0..T-2: aux of token t with the embedding of token t+1 -> (cache, hidden_out, logits)."""
    T = input_ids.shape[0]
    dtype = next(drafter.parameters()).dtype
    cache = DraftCache()
    hidden = drafter.fuse(aux_hidden[:-1].to(dtype)[None])
    pos = torch.arange(T - 1, device=input_ids.device)[None]
    h, lg = drafter.step(input_ids[1:][None], hidden, pos, cache)
    return cache, h[0], lg[0]


def target_index(drafter: Eagle3Drafter) -> torch.Tensor:
    """(V,) the draft id of each target id, -1 outside the draft vocab."""
    idx = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long, device=drafter.d2t.device)
    draft = torch.arange(drafter.d2t.shape[0], device=drafter.d2t.device)
    idx[drafter.draft_to_target(draft)] = draft
    return idx


@dataclass
class SampleInputs:
    input_ids: torch.Tensor  # (T,) long
    loss_mask: torch.Tensor  # (T,) long
    aux_hidden: torch.Tensor  # (T, 3Ht)
    topk_ids: torch.Tensor  # (T, K) long; the target's distribution over token t+1
    topk_logprobs: torch.Tensor  # (T, K)

    @classmethod
    def of(cls, item: dict, device: torch.device | str = "cpu") -> "SampleInputs":
        return cls(*(item[k].to(device) for k in ("input_ids", "loss_mask", "aux_hidden", "topk_ids", "topk_logprobs")))


@dataclass
class ChainResult:
    """Per root r = 1..T-1 (row r-1): acceptance per depth and whether the depth counts."""

    greedy_alpha: torch.Tensor  # (T-1, K) 0/1
    greedy_valid: torch.Tensor  # (T-1, K) bool
    sampled_alpha: torch.Tensor  # (T-1, K)
    sampled_valid: torch.Tensor  # (T-1, K) bool


def _depth_valid(s: SampleInputs, depth: int, greedy: bool) -> torch.Tensor:
    """(T-1, K): depth k of root r counts when token r+k exists and is a response token, and the root is one."""
    T = s.input_ids.shape[0]
    r = torch.arange(1, T, device=s.input_ids.device)[:, None]
    k = torch.arange(1, depth + 1, device=s.input_ids.device)[None]
    pos = r + k
    inside = pos <= T - 1
    pc = pos.clamp(max=T - 1)
    ok = inside & (s.loss_mask[pc] == 1) & (s.loss_mask[r] == 1)
    if greedy:
        # the stored token at r+k-1 (fed at depth k, k >= 2) must be the target's argmax
        is_greedy = torch.ones(T, dtype=torch.bool, device=s.input_ids.device)
        is_greedy[1:] = s.input_ids[1:] == s.topk_ids[:-1, 0]
        fed = (pos - 1).clamp(max=T - 1)
        ok = ok & ((k == 1) | is_greedy[fed])
    return torch.cumprod(ok.long(), dim=1).bool()


@torch.no_grad()
def chain_acceptance(
    drafter: Eagle3Drafter, s: SampleInputs, steps: int, temperature: float = 1.0, chunk: int = 512
) -> ChainResult:
    """The teacher-forced chain unroll over every root of one sample (see the module docstring)."""
    T = s.input_ids.shape[0]
    dev = s.input_ids.device
    t2d_idx = target_index(drafter)
    cache, h0, lg0 = _prefill(drafter, s.input_ids, s.aux_hidden)
    n_prefix = T - 1
    greedy = torch.zeros(n_prefix, steps, dtype=torch.float64, device=dev)
    sampled = torch.zeros_like(greedy)
    for a in range(0, n_prefix, chunk):
        roots = torch.arange(a, min(a + chunk, n_prefix), device=dev)  # entry index t = r - 1
        h, lg = h0[roots], lg0[roots]
        anc = torch.zeros(len(roots), 0, dtype=torch.long, device=dev)
        for k in range(1, steps + 1):
            if k > 1:
                tok = s.input_ids[(roots + k).clamp(max=T - 1)]  # ground truth r + k - 1
                h, lg, ent = _node_step(drafter, cache, n_prefix, tok, h, roots, anc, k - 1)
                anc = torch.cat([anc, ent[:, None]], dim=1)
            tpos = (roots + k).clamp(max=T - 1)  # the target's distribution over token r + k
            greedy[roots, k - 1] = (drafter.draft_to_target(lg.argmax(-1)) == s.topk_ids[tpos, 0]).double()
            sampled[roots, k - 1] = sampled_alpha(lg, s.topk_ids[tpos], s.topk_logprobs[tpos], t2d_idx, temperature)
        cache.crop(n_prefix)
    return ChainResult(greedy, _depth_valid(s, steps, True), sampled, _depth_valid(s, steps, False))


def sampled_alpha(draft_logits, topk_ids, topk_logprobs, t2d_idx, temperature: float) -> torch.Tensor:
    """sum_x min(p(x), q(x)): p over the stored top-k renormalised at `temperature`, q the draft softmax."""
    q = F.softmax(draft_logits.double() / temperature, dim=-1)  # (N, Vd)
    p = F.softmax(topk_logprobs.double() / temperature, dim=-1)  # (N, K)
    d = t2d_idx[topk_ids]  # (N, K)
    q_at = torch.where(d >= 0, q.gather(1, d.clamp(min=0)), torch.zeros_like(p))
    return torch.minimum(p, q_at).sum(-1)


@torch.no_grad()
def tree_accept(
    drafter: Eagle3Drafter, s: SampleInputs, steps: int, topk: int, num_draft_tokens: int, chunk: int = 256
):
    """Greedy accept length (bonus included) per root of SGLang's tree; (T-1,) long and (T-1,) bool valid."""
    T = s.input_ids.shape[0]
    dev = s.input_ids.device
    cache, h0, lg0 = _prefill(drafter, s.input_ids, s.aux_hidden)
    n_prefix = T - 1
    accept = torch.ones(n_prefix, dtype=torch.long, device=dev)
    budget = num_draft_tokens - 1
    for a in range(0, n_prefix, chunk):
        roots = torch.arange(a, min(a + chunk, n_prefix), device=dev)
        n = len(roots)
        logp = F.log_softmax(lg0[roots].float(), dim=-1)
        sc, tk = logp.topk(topk, dim=-1)  # (n, topk)
        tokens = drafter.draft_to_target(tk)
        # every expanded node: score, target token, parent node (-1 = root), depth
        all_sc, all_tok, all_par, all_dep = [sc], [tokens], [torch.full_like(tk, -1)], [torch.ones_like(tk)]
        front = torch.arange(topk, device=dev)[None].expand(n, topk)  # node ids of the frontier
        front_sc, front_tok = sc, tokens
        front_h = h0[roots][:, None].expand(n, topk, -1)
        front_anc = torch.zeros(n, topk, 0, dtype=torch.long, device=dev)
        n_nodes = topk
        for depth in range(1, steps):
            r_rep = roots[:, None].expand(n, topk).reshape(-1)
            h, lg, ent = _node_step(
                drafter,
                cache,
                n_prefix,
                front_tok.reshape(-1),
                front_h.reshape(n * topk, -1),
                r_rep,
                front_anc.reshape(n * topk, -1),
                depth,
            )
            child_lp, child_tk = F.log_softmax(lg.float(), dim=-1).topk(topk, dim=-1)  # (n*topk, topk)
            cand_sc = (front_sc.reshape(-1, 1) + child_lp).reshape(n, topk * topk)
            cand_tok = drafter.draft_to_target(child_tk).reshape(n, topk * topk)
            cand_par = front.repeat_interleave(topk, dim=1)  # (n, topk*topk)
            all_sc.append(cand_sc)
            all_tok.append(cand_tok)
            all_par.append(cand_par)
            all_dep.append(torch.full_like(cand_par, depth + 1))
            best_sc, best = cand_sc.topk(topk, dim=-1)  # (n, topk) the next frontier
            parent_slot = best // topk
            front = n_nodes + best
            front_sc, front_tok = best_sc, cand_tok.gather(1, best)
            h = h.reshape(n, topk, -1)
            ent = ent.reshape(n, topk)
            front_h = h.gather(1, parent_slot[..., None].expand(-1, -1, h.shape[-1]))
            front_anc = torch.cat(
                [
                    front_anc.gather(1, parent_slot[..., None].expand(-1, -1, front_anc.shape[-1])),
                    ent.gather(1, parent_slot)[..., None],
                ],
                dim=2,
            )
            n_nodes += topk * topk
        cache.crop(n_prefix)
        scores, tok, par, dep = (torch.cat(x, dim=1) for x in (all_sc, all_tok, all_par, all_dep))
        keep = torch.zeros_like(scores, dtype=torch.bool)
        keep.scatter_(1, scores.topk(min(budget, scores.shape[1]), dim=-1).indices, True)
        # walk the target's greedy path down the kept tree
        cur = torch.full((n,), -1, dtype=torch.long, device=dev)
        alive = torch.ones(n, dtype=torch.bool, device=dev)
        for depth in range(1, steps + 1):
            want = s.topk_ids[(roots + depth).clamp(max=T - 1), 0]  # the target's greedy token r + depth
            match = keep & (dep == depth) & (par == cur[:, None]) & (tok == want[:, None])
            found = match.any(1) & alive
            cur = torch.where(found, match.long().argmax(1), cur)
            accept[roots] += found.long()
            alive = found
    valid = _depth_valid(s, steps, greedy=True)[:, -1]
    return accept, valid


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
) -> AcceptReport:
    """Offline tau over an iterable of store items (dicts as FeatureStore.dataset yields)."""
    t0 = time.perf_counter()
    num_draft_tokens = num_draft_tokens or steps + 1
    samp_t = temperature if temperature > 0 else 1.0
    g, sm = ChainCounts.zeros(steps), ChainCounts.zeros(steps)
    tree_sum, tree_n, n_samples, n_roots = 0, 0, 0, 0
    for item in samples:
        s = SampleInputs.of(item, device)
        if s.input_ids.shape[0] < 2:
            continue
        res = chain_acceptance(drafter, s, steps, samp_t)
        g = g + ChainCounts.from_alpha(res.greedy_alpha, res.greedy_valid)
        sm = sm + ChainCounts.from_alpha(res.sampled_alpha, res.sampled_valid)
        if topk > 1:
            acc, valid = tree_accept(drafter, s, steps, topk, num_draft_tokens)
            tree_sum += int(acc[valid].sum())
            tree_n += int(valid.sum())
        n_samples += 1
        n_roots += int(res.greedy_valid[:, 0].sum())
    rep = AcceptReport(steps, topk, num_draft_tokens, samp_t, n_samples, n_roots)
    rep.greedy = {"tau": g.tau(), "per_depth": g.table()}
    rep.sampled = {"tau": sm.tau(), "temperature": samp_t, "per_depth": sm.table()}
    chain = g if temperature == 0 else sm
    for d in range(1, steps + 1):
        rep.settings[f"{d}/1/{d + 1}"] = {"tau": chain.tau(d), "kind": "chain"}
    if topk > 1:
        tau_tree = 1.0 * tree_sum / tree_n if tree_n else 0.0
        rep.tree = {"tau": tau_tree, "roots": tree_n, "acceptance": "greedy"}
        rep.settings[f"{steps}/{topk}/{num_draft_tokens}"] = {"tau": tau_tree, "kind": "tree (greedy)"}
        rep.headline_tau, rep.headline = tau_tree, "tree (greedy)"
    else:
        rep.headline_tau = chain.tau()
        rep.headline = "chain greedy" if temperature == 0 else f"chain sampled T={samp_t:g}"
    rep.seconds = time.perf_counter() - t0
    return rep


def format_report(rep: AcceptReport) -> str:
    lines = [
        f"offline accept length over {rep.samples} samples, {rep.roots} roots: tau = {rep.headline_tau:.3f} ({rep.headline})"
    ]
    lines.append(f"{'depth':>5} {'a_k greedy':>10} {'a_k sampled':>11} {'acc_k uncond':>12} {'chains':>7}")
    for gr, sr in zip(rep.greedy["per_depth"], rep.sampled["per_depth"]):
        lines.append(
            f"{gr['depth']:>5} {gr['a_k']:>10.3f} {sr['a_k']:>11.3f} {gr['acc_k_unconditional']:>12.3f} {gr['chains']:>7}"
        )
    lines.append(
        f"tau chain greedy {rep.greedy['tau']:.3f}; sampled (T={rep.sampled['temperature']:g}) {rep.sampled['tau']:.3f}"
    )
    if rep.tree:
        lines.append(
            f"tau tree {rep.steps}/{rep.topk}/{rep.num_draft_tokens} (greedy) {rep.tree['tau']:.3f} over {rep.tree['roots']} roots"
        )
    return "\n".join(lines)


def run(cfg, run_dir: Path) -> AcceptReport:
    """Load the exported drafter and the held-out features of `run_dir`, evaluate, write eval/accept_len.json."""
    from eagle3ft.config import resolve_path
    from eagle3ft.data.store import MANIFEST, FeatureStore
    from eagle3ft.drafter_config import check_drafter_folder
    from eagle3ft.targets.hf import load_input_embedding, pick_device
    from eagle3ft.train.checkpoint import load_drafter

    ec = cfg.eval
    ckpt = resolve_path(ec.checkpoint, base=run_dir)
    store = FeatureStore(run_dir / "features")
    check_drafter_folder(ckpt, store.target, "eval.checkpoint", str(store.dir / MANIFEST))  # before any compute
    device = pick_device(cfg.target)
    drafter = load_drafter(ckpt, embedding=load_input_embedding(cfg.target)).to(device).eval()
    ds = store.dataset("heldout")
    n = len(ds) if ec.max_samples is None else min(len(ds), ec.max_samples)
    rep = evaluate(drafter, (ds[i] for i in range(n)), ec.steps, ec.topk, ec.num_draft_tokens, ec.temperature, device)
    out = run_dir / "eval"
    out.mkdir(parents=True, exist_ok=True)
    held_out = [
        asdict(s) for s in cfg.harvest.sources if s.split in ("heldout", "auto")
    ]  # where the held-out split came from
    data = {
        "features": str(run_dir / "features"),
        "split": "heldout",
        "samples_in_split": len(ds),
        "sources": held_out,
        "heldout_fraction": cfg.harvest.heldout_fraction,
    }
    (out / "accept_len.json").write_text(json.dumps({**rep.to_dict(), "checkpoint": str(ckpt), "data": data}, indent=2))
    return rep


def main(argv: list[str] | None = None) -> None:
    from eagle3ft.config import cli_errors, parse_cli
    from eagle3ft.data.store import StoreError
    from eagle3ft.eval.preflight import check_or_exit

    cfg, run_dir, args = parse_cli(
        "Offline accept length of the drafter on held-out features.", stage="eval", argv=argv
    )
    check_or_exit("accept_len.py", "eval", cfg, run_dir, args.config)
    from eagle3ft.runlock import holding

    with holding(run_dir, "eval", "accept_len.py"), cli_errors("accept_len.py", StoreError):
        print(format_report(run(cfg, run_dir)))


if __name__ == "__main__":
    main()
