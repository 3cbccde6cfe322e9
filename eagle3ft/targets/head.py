"""The target's top-k next-token log-probs, from its final hidden states: what the harvest stores per token.

On CUDA with Triton, two kernels read each chunk of logits twice and sort nothing big:
  1. per row and block of BLOCK columns: the max of every group of GROUP columns, and the block's max and
     sum of exp in fp32 (the log-sum-exp of the row follows from the blocks');
  2. the k-th largest group max, tau, bounds the row's k-th largest value from below (the k largest group
     maxima are k distinct entries), so the top k are among the entries >= tau: the kernel appends those to
     a per-row list of CANDIDATES slots, one atomic increment per entry. A torch top-k over the list
     finishes the row.
A row with more candidates than slots (nearly flat logits) is redone by the torch path, so the result is
exact. Elsewhere (CPU, fp32, no Triton) the torch path is all: torch.topk and one fused fp32 log-softmax.
"""

from __future__ import annotations

import functools

import torch

HEAD_CHUNK_TOKENS = 2048  # rows of logits at a time (on CUDA 4x: fewer, larger kernels)
BLOCK = 4096  # logits columns per kernel program (a power of two)
GROUP = 512  # columns per group max (a power of two dividing BLOCK)
CANDIDATES = 256  # per-row slots for the entries >= tau


def topk_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (N, k) int32 and fp32 log-probs (N, k), sorted descending, from final hidden states (N, H)."""
    ids, lps, overflow = [], [], []
    chunk = HEAD_CHUNK_TOKENS * (4 if hidden.is_cuda else 1)
    for a in range(0, hidden.shape[0], chunk):
        logits = lm_head(hidden[a : a + chunk])  # (t, V) in the model's dtype
        if use_kernel(logits, k):
            i, lp, over = _fused(logits, k)
            overflow.append(over)
        else:
            i, lp = _torch(logits, k)
        ids.append(i)
        lps.append(lp)
    ids, lps = torch.cat(ids), torch.cat(lps)
    if overflow:
        redo = torch.cat(overflow).nonzero().flatten()  # the one wait: rows whose candidates did not fit
        if redo.numel():
            ids[redo], lps[redo] = _torch(lm_head(hidden[redo]), k)
    return ids, lps


def use_kernel(logits: torch.Tensor, k: int) -> bool:
    groups = -(-logits.shape[-1] // BLOCK) * (BLOCK // GROUP)
    return (
        logits.is_cuda
        and logits.dtype in (torch.bfloat16, torch.float16)
        and logits.is_contiguous()
        and k <= min(CANDIDATES, groups)
        and _kernels() is not None
    )


def _torch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = logits.topk(k, dim=-1)  # the same ids as on fp32 logits: the cast is exact and monotone
    # one fused fp32 log-softmax kernel reads the logits once; logsumexp(logits.float()) makes five passes
    lps = torch.log_softmax(logits, dim=-1, dtype=torch.float32).gather(-1, top.indices)  # (t, k)
    return top.indices.to(torch.int32), lps


def _fused(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, log-probs, overflow (t,) bool): rows flagged in overflow hold garbage and must be redone."""
    stats_kernel, candidates_kernel = _kernels()
    t, V = logits.shape
    nblk = -(-V // BLOCK)
    dev = logits.device
    maxima = torch.empty((t, nblk * (BLOCK // GROUP)), dtype=torch.float32, device=dev)  # (t, groups)
    stats = torch.empty((t, nblk, 2), dtype=torch.float32, device=dev)  # per block: max, sum exp(x - max)
    stats_kernel[(t, nblk)](logits, maxima, stats, V, logits.stride(0), BLOCK=BLOCK, GROUP=GROUP, num_warps=8)
    tau = maxima.topk(k, dim=-1).values[:, -1].contiguous()  # (t,) the k-th largest group max
    values = torch.full((t, CANDIDATES), float("-inf"), dtype=torch.float32, device=dev)  # (t, C)
    cols = torch.zeros((t, CANDIDATES), dtype=torch.int32, device=dev)
    count = torch.zeros(t, dtype=torch.int32, device=dev)
    candidates_kernel[(t, nblk)](
        logits, tau, values, cols, count, V, logits.stride(0), C=CANDIDATES, BLOCK=BLOCK, num_warps=8
    )
    top = values.topk(k, dim=-1)  # (t, k) sorted descending
    lse = torch.logsumexp(stats[..., 0] + stats[..., 1].log(), dim=-1, keepdim=True)  # (t, 1)
    return cols.gather(-1, top.indices), top.values - lse, count > CANDIDATES


@functools.cache
def _kernels():
    """(stats kernel, candidates kernel), or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def block_stats(logits, maxima, stats, V, stride, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        row, blk = tl.program_id(0), tl.program_id(1)
        col = blk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits + row * stride + col, mask=col < V, other=float("-inf")).to(tl.float32)  # (BLOCK,)
        gmax = tl.max(tl.reshape(x, (BLOCK // GROUP, GROUP)), axis=1)  # (BLOCK // GROUP,)
        groups: tl.constexpr = BLOCK // GROUP
        tl.store(maxima + (row * tl.num_programs(1) + blk) * groups + tl.arange(0, groups), gmax)
        m = tl.max(gmax, axis=0)
        s = tl.sum(tl.where(x > float("-inf"), tl.exp(x - m), 0.0), axis=0)  # 0, not NaN, for a block all -inf
        tl.store(stats + (row * tl.num_programs(1) + blk) * 2, m)
        tl.store(stats + (row * tl.num_programs(1) + blk) * 2 + 1, s)

    @triton.jit
    def block_candidates(logits, tau, values, cols, count, V, stride, C: tl.constexpr, BLOCK: tl.constexpr):
        row, blk = tl.program_id(0), tl.program_id(1)
        col = blk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits + row * stride + col, mask=col < V, other=float("-inf")).to(tl.float32)  # (BLOCK,)
        keep = (x >= tl.load(tau + row)) & (col < V)  # a few dozen entries of the row's ~V
        slot = tl.atomic_add(count + row + tl.zeros((BLOCK,), dtype=tl.int32), 1, mask=keep)  # one per kept entry
        ok = keep & (slot < C)
        tl.store(values + row * C + slot, x, mask=ok)
        tl.store(cols + row * C + slot, col, mask=ok)

    return block_stats, block_candidates
