"""The target's top-k next-token log-probs, from its final hidden states: what the harvest stores per token.

On CUDA, for 16-bit logits, one Triton kernel reads each chunk of logits once: every program takes BLOCK
columns of one row, computes their max and sum of exp in fp32, and their top k by a bitonic top-k over keys
that pack the value (as an order-preserving 16-bit integer) above its column. A small torch top-k over the
per-block candidates and a log-sum-exp over the per-block sums finish the row. Elsewhere (CPU, fp32, no
Triton) the same numbers come from torch.topk and one fused fp32 log-softmax.
"""

from __future__ import annotations

import functools

import torch

HEAD_CHUNK_TOKENS = 2048  # rows of logits at a time
BLOCK = 4096  # logits columns per kernel program (a power of two, at most 65536: the column sits in 16 bits)


def topk_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (N, k) int32 and fp32 log-probs (N, k), sorted descending, from final hidden states (N, H)."""
    ids, lps = [], []
    for a in range(0, hidden.shape[0], HEAD_CHUNK_TOKENS):
        logits = lm_head(hidden[a : a + HEAD_CHUNK_TOKENS])  # (t, V) in the model's dtype
        i, lp = (_fused if use_kernel(logits, k) else _torch)(logits, k)
        ids.append(i)
        lps.append(lp)
    return torch.cat(ids), torch.cat(lps)


def use_kernel(logits: torch.Tensor, k: int) -> bool:
    return (logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16) and logits.is_contiguous()
            and k <= BLOCK and k & (k - 1) == 0 and _kernel() is not None)


def _torch(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = logits.topk(k, dim=-1)  # the same ids as on fp32 logits: the cast is exact and monotone
    # one fused fp32 log-softmax kernel reads the logits once; logsumexp(logits.float()) makes five passes
    lps = torch.log_softmax(logits, dim=-1, dtype=torch.float32).gather(-1, top.indices)  # (t, k)
    return top.indices.to(torch.int32), lps


def _fused(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, V = logits.shape
    nblk = -(-V // BLOCK)
    keys = torch.empty((t, nblk, k), dtype=torch.int32, device=logits.device)  # per block: its top k, packed
    stats = torch.empty((t, nblk, 2), dtype=torch.float32, device=logits.device)  # per block: max, sum exp(x - max)
    _kernel()[(t, nblk)](logits, keys, stats, V, logits.stride(0), K=k, BLOCK=BLOCK, num_warps=4)
    top = keys.view(t, nblk * k).topk(k, dim=-1)  # (t, k) over the candidates of every block
    cols = (top.indices // k) * BLOCK + (top.values & 0xFFFF)  # block start + column within the block
    lse = torch.logsumexp(stats[..., 0] + stats[..., 1].log(), dim=-1, keepdim=True)  # (t, 1)
    return cols.to(torch.int32), logits.gather(-1, cols).float() - lse


@functools.cache
def _kernel():
    """The Triton kernel, or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    if not hasattr(tl, "topk"):  # Triton < 3.2
        return None

    @triton.jit
    def block_topk_lse(logits, keys, stats, V, stride, K: tl.constexpr, BLOCK: tl.constexpr):
        row, blk = tl.program_id(0), tl.program_id(1)
        col = tl.arange(0, BLOCK)
        ok = blk * BLOCK + col < V
        x = tl.load(logits + row * stride + blk * BLOCK + col, mask=ok, other=float("-inf"))  # (BLOCK,) 16-bit
        xf = x.to(tl.float32)
        m = tl.max(xf, axis=0)
        s = tl.sum(tl.where(xf > float("-inf"), tl.exp(xf - m), 0.0), axis=0)  # 0, not NaN, for a block all -inf
        bits = x.to(tl.int16, bitcast=True).to(tl.int32)  # sign-magnitude: flip the magnitude of negatives
        order = tl.where(bits < 0, bits ^ 0x7FFF, bits)  # now integer order == float order
        key = tl.where(ok, (order << 16) | col, -2147483648)  # value above column; padding loses
        top = tl.topk(key, K)  # (K,) descending
        out = row * tl.num_programs(1) + blk
        tl.store(keys + out * K + tl.arange(0, K), top)
        tl.store(stats + out * 2, m)
        tl.store(stats + out * 2 + 1, s)

    return block_topk_lse
