"""Offline τ of a DFlash drafter that predicts SGLang's live greedy τ: the live chain over anchors.

Greedy speculative decoding is lossless, so the committed text is the target's greedy continuation whatever the
drafter does, and SGLang's draft at committed length a depends only on the target features of positions < a and the
token at a. So one teacher-forced target pass over prompt + continuation gives every cycle the server could run:
acc(a) = the number of leading block positions whose draft equals the continuation's next tokens, for every anchor a
at or after the prompt (one batched drafter pass, anchors chunked: blocks never see each other). The server's cycles
are the walk a_0 = |prompt| (the prefill's token is the first bonus), a_{c+1} = a_c + acc(a_c) + 1, until the last
generated token is committed. Its accept length is the mean of acc + 1 over the walk; the request's
spec_accept_length is (1 + the commits, cut at the last token) / cycles = generated tokens / cycles. The mean of
1 + acc over every anchor (SpecForge's simulated accept length) is another, biased number: the walk skips the
positions a good cycle jumps over and revisits the ones right after a rejection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle3ft.drafter.dflash_model import DFlashDrafter, block_mask, block_positions, noise_ids


@torch.no_grad()
def anchor_drafts(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    tokens: torch.Tensor,
    start: int,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    chunk: int = 64,
) -> torch.Tensor:
    """Draft tokens (T - start, B - 1) for every anchor a = start..T-1 of one sequence: features (T, K·h) the target's
    layer outputs, tokens (T,); embed, lm_head (V, h) the target's. Row r is SGLang's draft at committed length
    start + r with bonus tokens[start + r]."""
    cfg = drafter.config
    if cfg.mask_token_id is None:
        raise ValueError(f"{cfg.path}: drafting needs dflash_config.mask_token_id")
    T, Bk = tokens.shape[0], cfg.block_size
    if not 0 <= start < T:
        raise ValueError(f"anchors start at {start}, outside the {T} tokens")
    c = drafter.context(features[None, : T - 1].to(embed.dtype))  # (1, T-1, h): the last anchor sees < T-1
    ctx_kv = drafter.context_kv(c, torch.arange(T - 1, device=tokens.device)[None])  # once for every chunk
    out = []
    for lo in range(start, T, chunk):
        anchors = torch.arange(lo, min(lo + chunk, T), device=tokens.device)[None]  # (1, n)
        S = int(anchors.max())  # a block sees < its anchor only
        ids = noise_ids(tokens[None], anchors, Bk, cfg.mask_token_id)  # (1, n·Bk)
        kv = [(k[:, :, :S], v[:, :, :S]) for k, v in ctx_kv]
        mask = block_mask(anchors, S, Bk)  # (1, n·Bk, S + n·Bk)
        hidden = drafter.blocks(F.embedding(ids, embed), block_positions(anchors, Bk), kv, mask)
        out.append((hidden[0].view(-1, Bk, hidden.shape[-1])[:, 1:] @ lm_head.t()).argmax(-1))  # (n, Bk - 1)
    return torch.cat(out)


def accepts(drafts: torch.Tensor, tokens: torch.Tensor, start: int) -> torch.Tensor:
    """acc(a) for a = start.. (n,): leading i >= 1 with drafts[a - start, i - 1] == tokens[a + i]; a position past
    the end of `tokens` is a mismatch (continue the text about a block past its end to avoid that end effect)."""
    n, width = drafts.shape
    T = tokens.shape[0]
    pos = torch.arange(start, start + n, device=drafts.device)[:, None] + torch.arange(1, width + 1)  # (n, B - 1)
    inside = pos < T
    truth = tokens[pos.clamp(max=T - 1)]
    return ((drafts == truth) & inside).int().cumprod(1).sum(1)


@dataclass
class DFlashWalk:
    """One request's live chain. Sum the counts over requests before taking a ratio."""

    anchors: list[int]  # committed length at each cycle
    accepted: list[int]  # acc(a_c): drafts the target accepted in cycle c
    generated: int  # tokens the request generated (the prefill's one included)
    anchor_sum: int  # sum over every anchor a in [start, end) of 1 + acc(a)
    anchor_count: int  # number of those anchors

    @property
    def cycles(self) -> int:
        return len(self.anchors)

    @property
    def tau(self) -> float:
        """The server's accept length: mean over cycles of acc + 1."""
        return (sum(self.accepted) + self.cycles) / self.cycles if self.cycles else float("nan")

    @property
    def spec_accept_length(self) -> float:
        """meta_info.spec_accept_length: (1 + commits, cut at the last token) / cycles."""
        return self.generated / self.cycles if self.cycles else float("nan")

    @property
    def all_anchor_tau(self) -> float:
        """The mean of 1 + acc over every anchor: not what the server measures."""
        return self.anchor_sum / self.anchor_count if self.anchor_count else float("nan")


def walk(acc: torch.Tensor | list[int], start: int, end: int) -> DFlashWalk:
    """The live chain over acc (acc[r] = acc(start + r)): start = |prompt|, end = the position of the last generated
    token (|prompt| + generated - 1). A cycle runs at committed length a while a < end."""
    acc = [int(x) for x in acc]
    if end < start or end - start > len(acc):
        raise ValueError(f"the walk [{start}, {end}) needs acc for {end - start} anchors, got {len(acc)}")
    anchors, accepted, a = [], [], start
    while a < end:
        anchors.append(a)
        accepted.append(acc[a - start])
        a += acc[a - start] + 1
    every = acc[: end - start]
    return DFlashWalk(anchors, accepted, end - start + 1, sum(every) + len(every), len(every))


def request_walk(
    drafter: DFlashDrafter,
    features: torch.Tensor,
    tokens: torch.Tensor,
    prompt_len: int,
    generated: int,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    chunk: int = 64,
) -> DFlashWalk:
    """One request: tokens (T,) = prompt + the target's greedy continuation (at least `generated` tokens; a block more
    avoids the end effect), features (T, K·h) of one teacher-forced pass over them."""
    if generated < 1 or prompt_len + generated > tokens.shape[0]:
        raise ValueError(f"{generated} generated tokens after a {prompt_len}-token prompt, {tokens.shape[0]} tokens")
    end = prompt_len + generated - 1
    drafts = (
        anchor_drafts(drafter, features[:end], tokens[:end], prompt_len, embed, lm_head, chunk)
        if end > prompt_len
        else None
    )
    acc = accepts(drafts, tokens, prompt_len) if drafts is not None else torch.zeros(0, dtype=torch.int)
    return walk(acc, prompt_len, end)
