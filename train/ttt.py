"""Training-time test (TTT): unroll the drafter K steps over harvested features, as EAGLE-3 trains it.

Step 0, row t: fc(aux[t]) and emb(token t+1) at position t predict token t+2, whose target
distribution is the one stored at position t+1. Step k feeds back step k-1's pre-norm output at the
same row, with emb(token t+1+k) at position t+k, and predicts token t+2+k (stored at t+1+k).
Attention at step k sees the step-0 keys 0..t (causal) and the row's own key of steps 1..k, as
SGLang's draft decode does at inference, in every decoder layer of a deeper drafter (`StepKeys`). The causal part runs through one flash-attention call; the
diagonal keys are merged with it through the causal part's log-sum-exp, so nothing O(k·T²) is built,
and the backward hands the merged output and log-sum-exp back to the flash backward.

Loss = Σ_k decay^k · mean over valid positions of CE(p, q), where p is the target's distribution
restricted to the draft vocabulary and renormalised, and q the drafter's. A position is valid at
step k when the predicted token t+2+k has loss_mask 1 and p has mass in the draft vocabulary. With a float
`loss_weight` (B, T) in the batch (train.loop_weight, train/batching.py) the mean is weighted: Σ w·loss / Σ w over
the valid positions, w of the predicted token.
Instead of CE, `loss_kind` picks an acceptance-targeted loss of the overlap Σ min(p, q): tv, lk, lk_hybrid.
The attention is train/attention.py; the losses, fused with the lm_head, train/losses.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from eagle3ft.drafter import wgrad
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.train.attention import Documents, shift, ttt_attention
from eagle3ft.train.losses import LOSSES, head_loss


@dataclass
class TTTOutput:
    """Loss plus detached per-step counts (sum counts over batches and ranks before any ratio)."""

    loss: torch.Tensor  # scalar, differentiable
    step_loss: torch.Tensor  # (K,) mean CE per step
    correct: torch.Tensor  # (K,) positions where the draft argmax equals the target argmax
    valid: torch.Tensor  # (K,) valid positions
    chain_correct: torch.Tensor  # (K,) matches at step k among positions whose steps < k all matched
    chain_valid: torch.Tensor  # (K,) positions valid at k whose steps < k were all valid and matched

    @property
    def acc(self) -> torch.Tensor:
        return self.correct / self.valid.clamp(min=1)

    @property
    def cond_acc(self) -> torch.Tensor:
        return self.chain_correct / self.chain_valid.clamp(min=1)


# --------------------------------------------------------------------------- targets


def target_to_draft_map(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(V,) long: the draft id of each target id, -1 outside the draft vocabulary."""
    draft_ids = torch.arange(d2t.shape[0], device=d2t.device)
    m = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    m[draft_ids + d2t] = draft_ids
    return m


def topk_to_draft(topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, t2d_map: torch.Tensor):
    """Stored top-k (…, K) over target ids -> (draft ids (…, K), p (…, K) renormalised, has_mass (…)).

    Mass on tokens outside the draft vocabulary is dropped; entries outside get id 0 and p 0.
    """
    ids = t2d_map[topk_ids.long()]  # (…, K)
    inside = ids >= 0
    p = topk_logprobs.float().exp() * inside
    mass = p.sum(-1, keepdim=True)  # (…, 1)
    return ids.clamp(min=0), p / mass.clamp(min=1e-30), mass[..., 0] > 0


# --------------------------------------------------------------------------- the unroll


class StepKeys:
    """Each drafter layer's keys and values over the unroll: step 0's (causal) and the diagonal ones of steps 1..k,
    which step k's attention reads (ttt_attention). A layer's first `attend` is its step 0."""

    def __init__(self, docs: Documents | None, compiled: bool) -> None:
        self.docs, self.compiled = docs, compiled
        self.first: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (B, nkv, T, hd) x2
        self.diag: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if layer not in self.first:
            self.first[layer], self.diag[layer] = (k, v), ([], [])
        else:
            self.diag[layer][0].append(k)
            self.diag[layer][1].append(v)
        return ttt_attention(q, *self.first[layer], *self.diag[layer], self.docs, self.compiled)  # (B, nh, T, hd)


def ttt_targets(model: Eagle3Drafter, batch: dict[str, torch.Tensor], target_head: torch.Tensor | None = None):
    """(target argmax (B, T), draft ids (B, T, K) or None, p (B, T, K) or (B, T, Vd), has_mass (B, T)).

    Row t holds the target's next-token distribution over token t+1: from the stored top-k, or with
    target_head (the target's lm_head rows of the draft vocabulary, (Vd, Ht)) the exact draft-vocab
    softmax of `last_hidden`.
    """
    target_argmax = batch["topk_ids"][..., 0].long()  # (B, T) the target's greedy next token, over token t+1
    if target_head is not None:
        with torch.no_grad():
            p_all = torch.softmax(
                (batch["last_hidden"].to(target_head.dtype) @ target_head.t()).float(), -1
            )  # (B, T, Vd)
        return target_argmax, None, p_all, torch.ones_like(batch["loss_mask"].bool())
    ids_all, p_all, has_mass = topk_to_draft(
        batch["topk_ids"], batch["topk_logprobs"], target_to_draft_map(model.d2t, model.config.vocab_size)
    )
    return target_argmax, ids_all, p_all, has_mass


def ttt_forward(
    model: Eagle3Drafter,
    batch: dict[str, torch.Tensor],
    steps: int = 7,
    decay: float = 0.8,
    target_head: torch.Tensor | None = None,
    loss_kind: str = "ce",
    lk_eta: float = 3.0,
) -> TTTOutput:
    """Unroll `steps` TTT steps over a collated batch (data/store.py's `collate`).

    target_head: the target's lm_head rows of the draft vocabulary (Vd, Ht), to take p from
    `last_hidden` (exact draft-vocab softmax) instead of the stored top-k.
    loss_kind: the per-position loss, one of LOSSES (see head_loss); lk_eta is lk_hybrid's eta.
    The decoder layers' and lm_head's weight gradients come as one GEMM each over all the steps (drafter/wgrad.py).
    """
    with wgrad.deferred():
        return _unroll(model, batch, steps, decay, target_head, loss_kind, lk_eta)


def _unroll(model, batch, steps, decay, target_head, loss_kind, lk_eta) -> TTTOutput:
    ids = batch["input_ids"].long()  # (B, T)
    B, T = ids.shape
    dtype = model.fc.weight.dtype
    dev = ids.device
    hidden = model.fuse(batch["aux_hidden"].to(dtype))  # (B, T, H); fc once
    docs = Documents(batch["position_ids"]) if "position_ids" in batch else None  # packed rows (train/batching.py)
    positions = docs.positions if docs is not None else torch.arange(T, device=dev).expand(B, T)
    loss_mask = batch["loss_mask"].bool()  # (B, T)
    weight = batch["loss_weight"].reshape(B * T) if "loss_weight" in batch else None  # (B*T,) float or None
    target_argmax, ids_all, p_all, has_mass = ttt_targets(model, batch, target_head)

    # the valid rows of every step at once: one host sync per batch instead of several per step
    valid = torch.stack(
        [shift(loss_mask, 2 + k) & shift(has_mass, 1 + k) for k in range(steps)]
    )  # (K, B, T) token t+2+k is trained on
    if docs is not None:  # ... and lies in row t's document
        valid &= torch.stack([docs.same(2 + k) for k in range(steps)])
    valid = valid.view(steps, B * T)
    counts = valid.sum(1)  # (K,)
    rows = valid.nonzero()[:, 1].split(counts.tolist())  # K × (N_k,) flat row indices b*T + t, ascending

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(B * T, *x.shape[2:])  # (B, T, …) -> (B*T, …)

    p_flat, ids_flat, argmax_flat = flat(p_all), flat(ids_all) if ids_all is not None else None, flat(target_argmax)

    loss = hidden.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(5, steps, device=dev)  # step_loss, correct, valid, chain_correct, chain_valid
    chain_ok = torch.ones(B * T, dtype=torch.bool, device=dev)
    keys = StepKeys(docs, model.blocks_compiled)
    for k in range(steps):
        tokens = shift(ids, 1 + k)  # (B, T) token t+1+k
        q, kk, vv = model.qkv(tokens, hidden, positions + k)  # q (B, nh, T, hd); kk, vv (B, nkv, T, hd)
        out = model.midlayer.finish(keys.attend(0, q, kk, vv), hidden)  # (B, T, H) pre-norm
        out = model.upper(out, positions + k, keys.attend)  # a deeper drafter's layers 1..

        r, ahead = rows[k], rows[k] + 1 + k  # (N,) valid rows; the rows holding their targets (t+1+k)
        xn = model.norm(flat(out).index_select(0, r))  # (N, H)
        p = p_flat.index_select(0, ahead)  # (N, K) or (N, Vd): the target distribution stored at t+1+k
        tid = ids_flat.index_select(0, ahead) if ids_flat is not None else None
        per_row, pred = model.lm_head(xn, partial(head_loss, ids=tid, p=p, loss=loss_kind, eta=lk_eta))  # (N,), (N,)
        n = counts[k]
        if weight is None:
            step_loss = per_row.sum() / n.clamp(min=1)
        else:  # w of the predicted token t+2+k, in row t's sample (valid rows never cross one)
            w = weight.index_select(0, r + 2 + k).float()  # (N,)
            step_loss = (per_row * w).sum() / w.sum().clamp(min=1e-30)
        loss = loss + decay**k * step_loss

        with torch.no_grad():
            hit = model.draft_to_target(pred) == argmax_flat.index_select(0, ahead)  # (N,)
            match = torch.zeros_like(chain_ok).scatter_(0, r, hit)  # (B*T,)
            chain_valid = chain_ok & valid[k]
            stats[:, k] = torch.stack(
                [step_loss.detach(), match.sum(), n, (chain_valid & match).sum(), chain_valid.sum()]
            ).float()
            chain_ok = chain_valid & match
        hidden = model.feedback(out)  # pre-norm out, or norm(out) with norm_output (EAGLE-3.1)
    return TTTOutput(loss, *stats)


class TTTObjective(torch.nn.Module):
    """The drafter plus its TTT loss as one module, so that a distributed engine runs `forward(batch)`."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        steps: int,
        decay: float,
        target_head: torch.Tensor | None = None,
        loss: str = "ce",
        lk_eta: float = 3.0,
    ) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"train.loss '{loss}' is not one of {', '.join(LOSSES)}")
        self.drafter, self.steps, self.decay, self.loss, self.lk_eta = drafter, steps, decay, loss, lk_eta
        self.register_buffer("target_head", target_head, persistent=False)  # (Vd, Ht) or None

    def forward(self, batch: dict[str, torch.Tensor], steps: int | None = None) -> TTTOutput:
        """The TTT unroll; `steps` overrides the training depth (held-out τ at the eval depth)."""
        return ttt_forward(
            self.drafter, batch, steps or self.steps, self.decay, self.target_head, self.loss, self.lk_eta
        )
