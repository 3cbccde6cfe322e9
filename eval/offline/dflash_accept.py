"""Offline τ of a DFlash drafter on the held-out features: the live chain walk (eagle3ft/drafter/dflash_walk.py),
in accept_len.json's form so that the report, the economics and `eagle3ft compare` read it as they read EAGLE-3's.

Per answer span [s, e) of each held-out sample (the prompt before it, the answer the target wrote), the server's
cycles run from anchor s (the prefill's token is the first bonus) until the answer's last token is committed. The
headline τ is the walk's mean of acc + 1 over every cycle of the set (the server's "accept len"); beside it the
requests' spec_accept_length form (generated tokens / cycles) and the biased mean over every anchor. The per-depth
table counts the walk's cycles: attempts_k = cycles whose drafts 1..k-1 were accepted, accepted_k = those accepting
k as well, so that τ = 1 + Σ_k Π_{j<=k} a_k as for EAGLE-3's chains; acc_k_unconditional is position k's hit rate
over every anchor. One setting, B-1/1/B: a DFlash cycle drafts B - 1 tokens and verifies B.
"""

from __future__ import annotations

import time

import torch

from eagle3ft.data.loops import answer_loops
from eagle3ft.drafter.dflash_model import DFlashDrafter
from eagle3ft.drafter.dflash_walk import accepts, anchor_drafts, walk
from eagle3ft.train.dflash_objective import answer_spans, walk_counts


@torch.no_grad()
def dflash_report(
    drafter: DFlashDrafter, items, embed: torch.Tensor, lm_head: torch.Tensor, device="cpu"
) -> tuple[dict, list[tuple[int, int]]]:
    """(accept_len.json's fields for a DFlash drafter over held-out items (input_ids, loss_mask, aux_hidden), the
    walk's (tokens, cycles) per sample)."""
    t0 = time.perf_counter()
    B = drafter.config.block_size
    width = B - 1
    dtype = next(drafter.parameters()).dtype
    embed, lm_head = embed.to(device, dtype), lm_head.to(device, dtype)
    correct, valid = [0] * width, [0] * width
    hits, anchors_n = [0] * width, 0
    accepted = cycles = generated = anchor_sum = anchor_count = samples = 0
    per_sample = []  # (tokens committed, cycles) per sample: the walk's interval
    for item in items:
        samples += 1
        ids = item["input_ids"].long().to(device)
        feats = item["aux_hidden"].to(device, dtype)
        s_tokens = s_cycles = 0
        for s, e in answer_spans(item["loss_mask"]):
            start, end = s, e - 1
            if end <= start:
                continue
            drafts = anchor_drafts(drafter, feats[:end], ids[:end], start, embed, lm_head)
            acc = accepts(drafts, ids[:e], start)
            w = walk(acc, start, end)
            c, v = walk_counts(w.accepted, width)
            correct = [x + y for x, y in zip(correct, c)]
            valid = [x + y for x, y in zip(valid, v)]
            pos = torch.arange(start, end, device=device)[:, None] + torch.arange(1, B, device=device)  # (n, B - 1)
            inside = pos < e
            truth = ids[pos.clamp(max=e - 1)]
            hit = ((drafts == truth) & inside).sum(0).tolist()
            hits = [x + y for x, y in zip(hits, hit)]
            anchors_n += end - start
            accepted, cycles, generated = accepted + sum(w.accepted), cycles + w.cycles, generated + w.generated
            anchor_sum, anchor_count = anchor_sum + w.anchor_sum, anchor_count + w.anchor_count
            s_tokens, s_cycles = s_tokens + sum(w.accepted) + w.cycles, s_cycles + w.cycles
        per_sample.append((s_tokens, s_cycles))
    tau = (accepted + cycles) / cycles if cycles else 1.0
    per_depth = []
    for k in range(width):
        per_depth.append(
            {
                "depth": k + 1,
                "attempts": float(valid[k]),
                "accepts": float(correct[k]),
                "a_k": correct[k] / valid[k] if valid[k] else 0.0,
                "acc_k_unconditional": hits[k] / anchors_n if anchors_n else 0.0,
                "chains": anchors_n,
                "reach_prob": correct[k] / cycles if cycles else 0.0,
            }
        )
    setting = {
        "tau": tau,
        "kind": "dflash chain walk (greedy)",
        "tau_walk": tau,
        "cycles_walk": cycles,
        "tau_walk_interval": None,  # accept_len.run sets it from per_sample (its walk_interval)
        "spec_accept_length": generated / cycles if cycles else None,
        "all_anchor_tau": anchor_sum / anchor_count if anchor_count else None,
    }
    greedy = {"tau": tau, "per_depth": per_depth}
    return {
        "kind": "dflash",
        "samples": samples,
        "roots": cycles,
        "anchors": anchors_n,
        "steps": width,
        "topk": 1,
        "num_draft_tokens": B,
        "block_size": B,
        "headline_tau": tau,
        "headline": "DFlash chain walk (greedy)",
        "spec_accept_length": setting["spec_accept_length"],
        "all_anchor_tau": setting["all_anchor_tau"],
        "greedy": greedy,
        "sampled": {"temperature": 0.0, **greedy},  # greedy verify only: the sampled table repeats the greedy one
        "settings": {f"{width}/1/{B}": setting},
        "seconds": time.perf_counter() - t0,
    }, per_sample


def format_dflash(rep: dict) -> str:
    lines = [
        f"offline accept length over {rep['samples']} samples, {rep['roots']} cycles of the live chain walk: "
        f"tau = {rep['headline_tau']:.3f} ({rep['headline']}, block {rep['block_size']})",
        f"spec_accept_length form {rep['spec_accept_length'] or float('nan'):.3f}; mean over every anchor "
        f"{rep['all_anchor_tau'] or float('nan'):.3f} (not what the server measures)",
        f"{'depth':>5} {'a_k walk':>9} {'acc_k every anchor':>19} {'attempts':>9}",
    ]
    for r in rep["greedy"]["per_depth"]:
        lines.append(f"{r['depth']:>5} {r['a_k']:>9.3f} {r['acc_k_unconditional']:>19.3f} {r['attempts']:>9.0f}")
    return "\n".join(lines)


@torch.no_grad()
def dflash_walk_totals(
    drafter: DFlashDrafter, item: dict, embed: torch.Tensor, lm_head: torch.Tensor, device="cpu"
) -> tuple[int, int, float, float]:
    """One sample's live chain walk as eval/offline/compare.py counts a walk: (tokens committed, cycles, loop-free
    tokens, loop-free cycles); a cycle at anchor a commits positions a + 1 .. a + acc + 1, and its share of loop-free
    tokens (data/loops.py) counts that share of the cycle."""
    B = drafter.config.block_size
    dtype = next(drafter.parameters()).dtype
    embed, lm_head = embed.to(device, dtype), lm_head.to(device, dtype)
    ids = item["input_ids"].long().to(device)
    feats = item["aux_hidden"].to(device, dtype)
    loops = answer_loops(ids.tolist(), item["loss_mask"].tolist())
    tokens = cycles = 0
    free_tokens = free_cycles = 0.0
    for s, e in answer_spans(item["loss_mask"]):
        if e - 1 <= s:
            continue
        drafts = anchor_drafts(drafter, feats[: e - 1], ids[: e - 1], s, embed, lm_head)
        w = walk(accepts(drafts[:, : B - 1], ids[:e], s), s, e - 1)
        for a, acc in zip(w.anchors, w.accepted):
            n = acc + 1
            free = n - sum(loops[a + 1 : a + 1 + n])
            tokens, cycles = tokens + n, cycles + 1
            free_tokens, free_cycles = free_tokens + free, free_cycles + free / n
    return tokens, cycles, free_tokens, free_cycles
