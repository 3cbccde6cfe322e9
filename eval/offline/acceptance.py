"""Acceptance of a drafter on one sample of held-out target features, per root and depth: the chain (greedy and
sampled) and the tree. eval/offline/accept_len.py sums it over the set into tau.

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
A depth counts only where the token exists and is a response token (loss_mask), and, for greedy,
where every earlier stored token equals the target's argmax (else the target's greedy path is
not in the data).

Tree (topk > 1, greedy): SGLang's tree is built by running the drafter on its own proposals: depth
1 takes the topk tokens of the root's distribution; each later depth expands topk children of each
of the topk best frontier nodes and keeps the topk best by cumulative draft probability as the next
frontier; finally the best num_draft_tokens-1 of all expanded nodes form the tree. Accepted = the
longest root path whose tokens all equal the target's greedy tokens (known offline where the stored
tokens are the greedy ones), plus the bonus. tau = mean over roots with every depth available; the cycle walk steps
over every root, a depth outside the data ending the path as in the chain.

Cycle walk (cycle_walk). The figures above average over every answer token as a root. A live greedy decoder starts
a cycle only where the last one ended: at root r it emits the accepted drafts plus the bonus, n tokens, and the next
cycle's root is r + n. Its roots lean towards the tokens right after a rejection, which are harder to draft than the
average token, so its tau is lower: 1.684 against 1.864 over every root at 3/1/4 on HumanEval prompts, where the
live decoder's was 1.692. Walking the same per-root
accept lengths from the first answer token, cycle by cycle, gives the tau a live greedy decoder has on these tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3ft.drafter.model import DraftCache, Eagle3Drafter


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


def chain_accept_lengths(res: ChainResult, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain of `depth` drafts: (T-1,) tokens emitted per root (bonus included), (T-1,) whether r is a root."""
    ok = (res.greedy_alpha[:, :depth] > 0.5) & res.greedy_valid[:, :depth]
    return 1 + torch.cumprod(ok.long(), dim=1).sum(1), res.greedy_valid[:, 0]


def cycle_walk(accept: torch.Tensor, is_root: torch.Tensor) -> list[int]:
    """The live decoder's cycles over one sample: the tokens each emits (bonus included), in order.

    accept (T-1,) tokens a cycle at each root would emit, is_root (T-1,) bool. The first cycle starts at the first
    root; a cycle at row i emits accept[i] and the next starts at row i + accept[i], or at the first root after it
    (a new answer turn starts a new walk).
    """
    return [n for _, n in cycle_walk_rows(accept, is_root)]


def cycle_walk_rows(accept: torch.Tensor, is_root: torch.Tensor) -> list[tuple[int, int]]:
    """cycle_walk's cycles as (row, tokens emitted): the cycle at row i (root token i + 1) emits the tokens at
    positions i + 2 .. i + 1 + tokens."""
    cycles, nxt = [], 0
    for i, (n, ok) in enumerate(zip(accept.tolist(), is_root.tolist())):
        if ok and i >= nxt:
            cycles.append((i, n))
            nxt = i + n
    return cycles


def sampled_alpha(draft_logits, topk_ids, topk_logprobs, t2d_idx, temperature: float) -> torch.Tensor:
    """sum_x min(p(x), q(x)): p over the stored top-k renormalised at `temperature`, q the draft softmax."""
    q = F.softmax(draft_logits.double() / temperature, dim=-1)  # (N, Vd)
    p = F.softmax(topk_logprobs.double() / temperature, dim=-1)  # (N, K)
    d = t2d_idx[topk_ids]  # (N, K)
    q_at = torch.where(d >= 0, q.gather(1, d.clamp(min=0)), torch.zeros_like(p))
    return torch.minimum(p, q_at).sum(-1)


TREE_CONTEXTS = ("slots", "ancestors")


@torch.no_grad()
def tree_accept(
    drafter: Eagle3Drafter,
    s: SampleInputs,
    steps: int,
    topk: int,
    num_draft_tokens: int,
    context: str = "slots",
    chunk: int = 256,
):
    """Greedy accept length (bonus included) per root of SGLang's tree: (T-1,) long; (T-1,) bool whether r is a root;
    (T-1,) bool whether every depth of it is in the data. As the chain's (chain_accept_lengths), a depth that is not
    in the data (past the answer's end, or fed a stored token that is not the target's argmax) ends the accepted path
    there: the cycle walk then steps over every root, where skipping the roots with a missing depth would skip the
    ones next to the target's near-ties and the answer's last tokens.

    context: what a frontier node attends to besides the prefix. "slots" is SGLang's draft decode: the frontier is
    topk slots in score order, and the node in slot j attends to the nodes that held slot j at the earlier depths
    (generate_draft_decode_kv_indices), whichever slot its parent held; its input hidden state is still its parent's
    output. "ancestors" is the exact tree (EAGLE's tree mask): the node attends to its own ancestors.
    """
    if context not in TREE_CONTEXTS:
        raise ValueError(f"tree context {context!r}: one of {TREE_CONTEXTS}")
    T = s.input_ids.shape[0]
    dev = s.input_ids.device
    cache, h0, lg0 = _prefill(drafter, s.input_ids, s.aux_hidden)
    n_prefix = T - 1
    accept = torch.ones(n_prefix, dtype=torch.long, device=dev)
    in_data = _depth_valid(s, steps, greedy=True)  # (T-1, steps)
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
            if context == "ancestors":
                front_anc = torch.cat(
                    [
                        front_anc.gather(1, parent_slot[..., None].expand(-1, -1, front_anc.shape[-1])),
                        ent.gather(1, parent_slot)[..., None],
                    ],
                    dim=2,
                )
            else:  # slot j keeps slot j's history
                front_anc = torch.cat([front_anc, ent[..., None]], dim=2)
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
            found = match.any(1) & alive & in_data[roots, depth - 1]
            cur = torch.where(found, match.long().argmax(1), cur)
            accept[roots] += found.long()
            alive = found
    return accept, in_data[:, 0], in_data[:, -1]
