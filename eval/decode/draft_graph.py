"""The drafter's part of a greedy cycle with no host round trip, replayed as CUDA graphs (`bench.embedded.drafting`).

eval/decode/speculate.py drafts a chain one drafter forward at a time: each draft token goes to the host (`int`) and back
as the next forward's input, and each forward launches ~110 small ops. Where launches bound a forward (a 1-layer
drafter at batch 1 on a GPU: 1.1-1.3 ms a forward) that is most of a draft step. Here the chain after the extend
stays on the device, draft ids included, so it can be captured once as a CUDA graph (0.19 ms a forward):

  d_0 = argmax(logits of the extend)                                  (target ids through d2t)
  for j in 1..steps-1:  h, logits = drafter forward on (d_{j-1}, h) at position pos + j - 1,
                        its key/value written in place at that cache row (DraftCache.static)
                        d_j = argmax(logits)
  -> drafts (steps,)

With `extend` (`bench.embedded.draft_graph_extend`), the extend after a verify (the drafter over the T = 1..steps+1
accepted tokens and their aux features) is captured too, one graph per T, and writes the chain's inputs in place;
the prompt's extend stays eager. tests/test_gpu.py holds that capture to the eager extend; its speed is not
measured yet.

Attention reads the whole static buffer with a mask of the rows <= each query's position, where the eager step
reads the rows so far: the same keys, another kernel, so bf16 logits may differ in the last bits. `static_forward`
and `chain_drafts` are the algorithm and run anywhere (tests/test_eval_draft_graph.py holds them to the eager
drafter on the CPU); `DraftGraph` captures them on CUDA (tests/test_gpu.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3ft.drafter.model import DraftCache, Eagle3Drafter


def static_forward(
    drafter: Eagle3Drafter,
    cache: DraftCache,
    ids: torch.Tensor,
    hidden: torch.Tensor,
    at: torch.Tensor,
    rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eagle3Drafter.step over T new tokens at cache rows `at` (T,) long (their rope positions too), keys and values
    written there in place, each token attending to the rows <= its own. ids (1, T), hidden (1, T, H) -> (feedback
    (1, T, H), logits (1, T, Vd)); rows (capacity,) arange. No host sync: what a CUDA graph captures."""
    gqa = drafter.config.num_key_value_heads != drafter.config.num_attention_heads
    seen = (rows.view(1, -1) <= at.view(-1, 1)).view(1, 1, at.shape[0], -1)  # (1, 1, T, capacity)

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = cache.layer(i)  # q (1, nh, T, hd), k/v (1, nkv, T, hd) written at rows `at` of layer i's buffers
        c.k.index_copy_(2, at, k)
        c.v.index_copy_(2, at, v)
        return F.scaled_dot_product_attention(q, c.k, c.v, attn_mask=seen, enable_gqa=gqa)  # (1, nh, T, hd)

    out = drafter.midlayer.finish(attend(0, *drafter.qkv(ids, hidden, at.view(1, -1))), hidden)
    return drafter.outputs(drafter.upper(out, at.view(1, -1), attend))


def chain_drafts(
    drafter: Eagle3Drafter,
    cache: DraftCache,
    logits: torch.Tensor,
    h: torch.Tensor,
    pos: torch.Tensor,
    rows: torch.Tensor,
    steps: int,
) -> torch.Tensor:
    """Greedy drafts (steps,) target ids. logits (Vd,) of the extend's last entry, h (1, 1, H) its feedback, pos (1,)
    long: the cache row (and rope position) of the first draft forward, == cache.length; rows (capacity,) arange."""
    d = drafter.draft_to_target(logits.argmax(-1, keepdim=True))  # (1,)
    drafts = [d]
    for j in range(steps - 1):
        h, lg = static_forward(drafter, cache, d.view(1, 1), h, pos + j, rows)  # (1, 1, H), (1, 1, Vd)
        d = drafter.draft_to_target(lg[0, -1].argmax(-1, keepdim=True))
        drafts.append(d)
    return torch.cat(drafts)  # (steps,)


class DraftGraph:
    """The drafter's part of a cycle for one drafter and `steps`, over a static DraftCache of `capacity` rows:
    chain_drafts, and with `extend` the extend over the T = 1..steps+1 tokens a verify accepts (fused aux features in,
    the last token's feedback and logits out, into the chain's inputs). On CUDA each is captured once as a CUDA graph
    (the extend once per T) and replayed; elsewhere they run as they are. `cache` is the one the decoder's extends
    use."""

    def __init__(
        self, drafter: Eagle3Drafter, steps: int, capacity: int, device: torch.device, extend: bool = False
    ) -> None:
        dtype = next(drafter.parameters()).dtype
        cfg = drafter.config
        self.drafter, self.steps, self.capacity = drafter, steps, capacity
        self.cache = DraftCache.static(cfg, capacity, device, dtype)
        self.rows = torch.arange(capacity, device=device)
        self.offsets = torch.arange(steps + 1, device=device)
        # the inputs, copied in per run; the extend writes its outputs into the chain's logits and h
        self.logits = torch.zeros(cfg.draft_vocab_size, device=device, dtype=dtype)
        self.h = torch.zeros(1, 1, cfg.hidden_size, device=device, dtype=dtype)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.ids = {t: torch.zeros(1, t, dtype=torch.long, device=device) for t in range(1, steps + 2) if extend}
        self.aux = {t: torch.zeros(1, t, 3 * cfg.target_hidden_size, device=device, dtype=dtype) for t in self.ids}
        self.graphs: dict[int | str, torch.cuda.CUDAGraph] = {}  # "chain", and each extend size T
        self.drafts = None
        if device.type == "cuda":
            self._capture()

    def _chain(self) -> torch.Tensor:
        return chain_drafts(self.drafter, self.cache, self.logits, self.h, self.pos, self.rows, self.steps)

    def _extend(self, t: int) -> None:
        h, lg = static_forward(
            self.drafter, self.cache, self.ids[t], self.drafter.fuse(self.aux[t]), self.pos + self.offsets[:t],
            self.rows,
        )  # fmt: skip
        self.h.copy_(h[:, -1:])
        self.logits.copy_(lg[0, -1])

    @torch.no_grad()
    def _capture(self) -> None:
        work = {"chain": self._chain, **{t: (lambda t=t: self._extend(t)) for t in self.ids}}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (cuBLAS handles, kernel selection)
            for fn in work.values():
                fn()
                fn()
        torch.cuda.current_stream().wait_stream(side)
        for key, fn in work.items():  # each in a memory pool of its own: the extends replay in any order
            self.graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graphs[key]):
                out = fn()
            if key == "chain":
                self.drafts = out
        self.cache.length = 0  # the warm-up and captures wrote rows 0..steps; the next prefill overwrites them

    def _check(self, last_row: int) -> None:
        if last_row >= self.capacity:
            raise ValueError(f"the drafter reaches row {last_row} of a {self.capacity}-row static cache")

    def extend(self, ids: list[int], aux: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter over len(ids) <= steps + 1 tokens at cache rows start.. (entry j: aux (T, 3Ht) of token j, the
        embedding of ids[j]): (feedback (1, 1, H), logits (Vd,)) of the last, in the chain's input buffers."""
        t = len(ids)
        if not self.ids:
            raise ValueError("this DraftGraph was built without extend")
        if t not in self.ids:
            raise ValueError(f"this DraftGraph extends 1..{len(self.ids)} tokens at a time, not {t}")
        self._check(start + t - 1)
        if start != self.cache.length:
            raise ValueError(f"an extend at row {start} of a static cache holding {self.cache.length} rows")
        self.ids[t].copy_(torch.tensor([ids]))
        self.aux[t].copy_(aux[None])
        self.pos.fill_(start)
        if self.graphs:
            self.graphs[t].replay()
        else:
            self._extend(t)
        self.cache.length = start + t
        return self.h, self.logits

    def run(self, logits: torch.Tensor, h: torch.Tensor, pos: int) -> list[int]:
        """The chain's drafts (target ids) from the extend's logits (Vd,) and feedback (1, 1, H) at cache row `pos`."""
        self._check(pos + self.steps - 2)
        if logits is not self.logits:  # an eager extend's outputs (the prompt's); the graphed one wrote them here
            self.logits.copy_(logits)
            self.h.copy_(h)
        self.pos.fill_(pos)
        if not self.graphs:
            return self._chain().tolist()
        self.graphs["chain"].replay()
        return self.drafts.tolist()
