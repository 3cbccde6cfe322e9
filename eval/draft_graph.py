"""The greedy draft chain of one cycle with no host round trip, replayed as one CUDA graph (`bench.drafting`).

eval/speculate.py drafts a chain one drafter forward at a time: each draft token goes to the host (`int`) and back
as the next forward's input, and each forward launches ~110 small ops. Where launches bound a forward (a 1-layer
drafter at batch 1 on a GPU: 1.1-1.3 ms a forward on the H200, RESULTS §17b, §18a) that is most of a draft step.
Here the chain after the extend stays on the device, draft ids included, so it can be captured once as a CUDA graph
(0.19 ms a forward on the H200, §18a):

  d_0 = argmax(logits of the extend)                                  (target ids through d2t)
  for j in 1..steps-1:  h, logits = drafter forward on (d_{j-1}, h) at position pos + j - 1,
                        its key/value written in place at that cache row (StaticDraftCache)
                        d_j = argmax(logits)
  -> drafts (steps,)

The one-token attention reads the whole static buffer with a mask of the rows <= its position, where the eager step
reads the rows so far without one: the same keys, another kernel, so bf16 logits may differ in the last bits.
`chain_drafts` is the algorithm and runs anywhere (tests/test_eval_draft_graph.py holds it to the eager chain on
the CPU); `DraftGraph` captures it on CUDA (tests/test_gpu.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3ft.train.model import Eagle3Drafter, StaticDraftCache


def chain_drafts(
    drafter: Eagle3Drafter,
    cache: StaticDraftCache,
    logits: torch.Tensor,
    h: torch.Tensor,
    pos: torch.Tensor,
    rows: torch.Tensor,
    steps: int,
) -> torch.Tensor:
    """Greedy drafts (steps,) target ids. logits (Vd,) of the extend's last entry, h (1, 1, H) its feedback, pos (1,)
    long: the cache row (and rope position) of the first draft forward, == cache.length; rows (capacity,) arange."""
    gqa = drafter.config.num_key_value_heads != drafter.config.num_attention_heads
    d = drafter.draft_to_target(logits.argmax(-1, keepdim=True))  # (1,)
    drafts = [d]
    for j in range(steps - 1):
        p = pos + j  # (1,)
        q, k, v = drafter.qkv(d.view(1, 1), h, p.view(1, 1))  # q (1, nh, 1, hd), k/v (1, nkv, 1, hd)
        cache.k.index_copy_(2, p, k)
        cache.v.index_copy_(2, p, v)
        seen = (rows <= p).view(1, 1, 1, -1)  # (1, 1, 1, capacity): the rows so far and this one
        o = F.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=seen, enable_gqa=gqa)  # (1, nh, 1, hd)
        h, lg = drafter.outputs(drafter.midlayer.finish(o, h))  # (1, 1, H), (1, 1, Vd)
        d = drafter.draft_to_target(lg[0, -1].argmax(-1, keepdim=True))
        drafts.append(d)
    return torch.cat(drafts)  # (steps,)


class DraftGraph:
    """chain_drafts for one drafter and `steps`, over a StaticDraftCache of `capacity` rows; on CUDA captured once as
    a CUDA graph and replayed per cycle, elsewhere run as it is. `cache` is the one the decoder's extends use."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, capacity: int, device: torch.device) -> None:
        dtype = next(drafter.parameters()).dtype
        cfg = drafter.config
        self.drafter, self.steps, self.capacity = drafter, steps, capacity
        self.cache = StaticDraftCache(cfg, capacity, device, dtype)
        self.rows = torch.arange(capacity, device=device)
        self.logits = torch.zeros(cfg.draft_vocab_size, device=device, dtype=dtype)  # the inputs, copied in per run
        self.h = torch.zeros(1, 1, cfg.hidden_size, device=device, dtype=dtype)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graph, self.drafts = None, None
        if device.type == "cuda":
            self._capture()

    def _chain(self) -> torch.Tensor:
        return chain_drafts(self.drafter, self.cache, self.logits, self.h, self.pos, self.rows, self.steps)

    @torch.no_grad()
    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (cuBLAS handles, kernel selection)
            for _ in range(2):
                self._chain()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.drafts = self._chain()
        self.cache.length = 0  # the warm-up and capture wrote rows 0..steps-2; the next prefill overwrites them

    def run(self, logits: torch.Tensor, h: torch.Tensor, pos: int) -> list[int]:
        """The chain's drafts (target ids) from the extend's logits (Vd,) and feedback (1, 1, H) at cache row `pos`."""
        if pos + self.steps - 1 > self.capacity:
            raise ValueError(f"the draft chain reaches row {pos + self.steps - 1} of a {self.capacity}-row cache")
        self.logits.copy_(logits)
        self.h.copy_(h)
        self.pos.fill_(pos)
        if self.graph is None:
            return self._chain().tolist()
        self.graph.replay()
        return self.drafts.tolist()
