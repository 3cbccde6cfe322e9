"""Harvest: prompts -> the target regenerates the answers -> features in the store.

    python data/harvest.py --config configs/smollm2-135m.yaml --run-dir runs/smol

The conversations are put in a fixed order and cut into chunks of
``harvest.shard_samples`` per split; each chunk becomes one shard, committed
whole. Rerunning the same command skips the chunks already done, so a killed
harvest resumes without losing or duplicating a sample. At the end the
loss-masked token counts and the draft vocabulary (``run_dir/vocab.safetensors``)
are written, and a summary goes to stdout and ``features/summary.json``.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # run as a script (`eagle3ft STAGE` sets it in eagle3ft/commands.py); before torch loads
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import hashlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from eagle3ft.cli import run_stage, save_resolved
from eagle3ft.config import Config, HarvestConfig, TargetConfig, resolve_path, to_dict
from eagle3ft.data.aux_rows import row_checker
from eagle3ft.data.chat import ChatFormat
from eagle3ft.data.checks import HarvestRefused, argmax_check, check_argmax_rate, check_aux_rows
from eagle3ft.data.contamination import heldout_filter
from eagle3ft.data.prompts import Conversation, check_source, collect, source_identity
from eagle3ft.data.readers import Skips
from eagle3ft.data.sources import sample_id
from eagle3ft.data.store import AUX_DTYPES, SPLITS, FeatureStore, StoreError
from eagle3ft.data.store_writer import FeatureWriter, Sample
from eagle3ft.data.tokens import check_tokenizer
from eagle3ft.drafter.dflash_config import DFlashConfig
from eagle3ft.drafter.folder import drafter_spec
from eagle3ft.drafter.vocab import build_vocab, check_vocab, save_vocab, vocab_from_drafter
from eagle3ft.files import write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.targets import open_target
from eagle3ft.targets.base import Request, Sampling, Target
from eagle3ft.targets.hf import load_tokenizer


@dataclass
class ChunkStats:
    generated_tokens: int = 0
    captured_tokens: int = 0
    unfinished_answers: int = 0  # answers cut by max_new_tokens / max_total_tokens
    skips: Counter = field(default_factory=Counter)
    argmax: Counter = field(default_factory=Counter)  # T=0 check: checked, mismatched, ties
    rows: Counter = field(default_factory=Counter)  # aux row check (data/aux_rows.py): before, here, after


def request_seed(base: int, key: str, turn: int) -> int:
    return int(hashlib.sha256(f"{base}:{key}:{turn}".encode()).hexdigest()[:8], 16)


def features_ok(sample: Sample) -> bool:
    hidden = [sample.aux_hidden] + ([sample.last_hidden] if sample.last_hidden is not None else [])
    return all(bool(torch.isfinite(h).all()) for h in hidden) and not bool(torch.isnan(sample.topk_logprobs).any())


def make_sample(conv: Conversation, ids: list[int], mask: list[int], result) -> Sample:
    f = result.features
    return Sample(
        sample_id=sample_id(conv.key),
        input_ids=torch.tensor(ids, dtype=torch.int32),
        loss_mask=torch.tensor(mask, dtype=torch.uint8),
        aux_hidden=f.aux_hidden,
        topk_ids=f.topk_ids,
        topk_logprobs=f.topk_logprobs,
        last_hidden=f.last_hidden,
        source=conv.source,
    )


@dataclass(frozen=True)
class HarvestJob:
    """What every batch of a harvest shares: the target and its chat format, the settings, sampling and seed."""

    target: Target
    chat: ChatFormat
    h: HarvestConfig
    sampling: Sampling
    seed: int


def harvest_batch(job: HarvestJob, convs: list[Conversation], stats: ChunkStats) -> dict[str, Sample]:
    """Samples (by conversation key) of one batch; the target writes every assistant turn, turn by turn."""
    target, chat, h, sampling, seed = job.target, job.chat, job.h, job.sampling, job.seed
    stop = tuple(chat.stop_ids)
    out: dict[str, Sample] = {}
    fixed = [
        c for c in convs if c.ids is not None or not h.regenerate
    ]  # captured as they are: a token store's ids, or the dataset's answers
    if fixed:
        reqs, kept = [], []
        for c in fixed:
            ids, mask = (c.ids.tolist(), c.loss_mask.tolist()) if c.ids is not None else chat.encode(c.messages)
            if len(ids) > h.max_total_tokens:
                stats.skips["too_long"] += 1
                continue
            reqs.append(Request(ids, 0, stop, capture=True))
            kept.append((c, ids, mask))
        for (c, ids, mask), r in zip(kept, target.process(reqs, sampling) if reqs else []):
            out[c.key] = make_sample(c, ids, mask, r)
    convs = [c for c in convs if c.ids is None and h.regenerate]
    history = {c.key: [m for m in c.messages if m["role"] == "system"] for c in convs}
    users = {c.key: [m for m in c.messages if m["role"] == "user"] for c in convs}
    active = list(convs)
    turn = 0
    while active:
        reqs, pending = [], []
        for c in active:
            history[c.key].append(users[c.key][turn])
            ids, mask = chat.encode(history[c.key], add_generation_prompt=True)
            budget = min(h.max_new_tokens, h.max_total_tokens - len(ids))
            if budget <= 0:
                stats.skips["too_long"] += 1
                continue
            last = turn == len(users[c.key]) - 1
            reqs.append(Request(ids, budget, stop, capture=last, seed=request_seed(seed, c.key, turn)))
            pending.append((c, ids, mask, last, budget))
        results = target.process(reqs, sampling) if reqs else []
        active = []
        for (c, ids, mask, last, budget), r in zip(pending, results):
            done = bool(r.completion_ids) and r.completion_ids[-1] in stop
            stats.generated_tokens += len(r.completion_ids)
            stats.unfinished_answers += not done
            if last:
                out[c.key] = make_sample(c, ids + r.completion_ids, mask + [1] * len(r.completion_ids), r)
                if sampling.temperature == 0:
                    stats.argmax += argmax_check(
                        r.completion_ids, r.features.topk_ids, r.features.topk_logprobs, len(ids), h.argmax_tie_eps
                    )
            else:
                history[c.key].append({"role": "assistant", "content": chat.decode(r.completion_ids)})
                active.append(c)
        turn += 1
    return out


def harvest_chunk(
    job: HarvestJob, convs: list[Conversation], on_batch, row_check=None
) -> tuple[list[Sample], ChunkStats]:
    """One chunk -> its samples in conversation order. Batches group similar prompt lengths.

    `on_batch(samples, tokens)` is called after each batch (progress); `row_check(sample)` counts where the sample's
    aux rows sit (data/aux_rows.py).
    """
    stats = ChunkStats()
    order = sorted(
        convs, key=lambda c: (len(c.ids) if c.ids is not None else sum(len(m["content"]) for m in c.messages), c.key)
    )
    done: dict[str, Sample] = {}
    for b in range(0, len(order), job.h.batch_size):
        batch = order[b : b + job.h.batch_size]
        got = harvest_batch(job, batch, stats)
        tokens = 0
        for key, s in got.items():
            if features_ok(s):
                done[key] = s
                tokens += len(s.input_ids)
                if row_check is not None:
                    stats.rows += row_check(s)
            else:
                stats.skips["nonfinite_features"] += 1
        stats.captured_tokens += tokens
        on_batch(len(batch), tokens)
    return [done[c.key] for c in convs if c.key in done], stats


# harvest keys outside the fingerprint: how requests are sent and checked (a rerun may change them and resume), the
# sources (fingerprinted by content below) and magpie (data/magpie.py's)
NOT_FINGERPRINTED = (
    "sglang",
    "batch_size",
    "argmax_tie_eps",
    "argmax_max_mismatch",
    "aux_row_check",
    "magpie",
    "sources",
)


def fingerprint(harvest: HarvestConfig, target: TargetConfig, seed: int, convs: list[Conversation]) -> str:
    """What must match for a rerun to resume this harvest: the sample order and how samples are made."""
    h = harvest
    what = {
        "keys": [(c.key, c.split) for c in convs],
        "harvest": {k: v for k, v in to_dict(h).items() if k not in NOT_FINGERPRINTED},
        "sources": source_identity(h.sources),
        "chat_template": target.chat_template,
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def check_harvest_config(h: HarvestConfig) -> None:
    """What a harvest needs beyond the bounds HarvestConfig checks itself: a train split, a known aux dtype."""
    if h.heldout_fraction >= 1.0:
        raise ValueError(f"harvest.heldout_fraction must be in [0, 1), got {h.heldout_fraction}")
    if h.aux_dtype not in AUX_DTYPES:
        raise ValueError(f"harvest.aux_dtype {h.aux_dtype!r} is not one of {', '.join(AUX_DTYPES)}")


def conversations(
    h: HarvestConfig, prompt_fits: Callable[[list[dict]], str | None], regenerate: bool
) -> tuple[list[Conversation], Skips]:
    """harvest.sources' conversations (split, deduped, none sharing an 8-gram with a held-out set) whose prompts
    pass `prompt_fits`, and the skips by reason; ValueError when none is left."""
    prompt_skips = Skips()  # by reason, and where the first few of each are
    convs = collect(
        h.sources,
        max_turns=h.max_turns,
        regenerate=regenerate,
        heldout_fraction=h.heldout_fraction,
        dedupe=h.dedupe,
        skips=prompt_skips,
        check=prompt_fits,
        heldout=heldout_filter(h.sources, h.magpie.heldout, (h.max_turns, regenerate, h.heldout_fraction)),
    )
    if not convs:
        raise ValueError(f"no usable conversation in harvest.sources (skips: {dict(prompt_skips)})")
    return convs, prompt_skips


def masked_token_counts(features_dir: Path, vocab_size: int) -> torch.Tensor:
    """Counts of target tokens under loss_mask == 1 in the train split."""
    from safetensors import safe_open

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for path in FeatureStore(features_dir, verify=False).shards("train"):
        with safe_open(path, framework="pt") as f:
            ids = f.get_tensor("input_ids").long()
            mask = f.get_tensor("loss_mask").bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)
    return counts


def run_harvest(cfg: Config, run_dir: str | Path, record: bool = False) -> dict:
    """The whole harvest; returns the summary. Every input is checked before the target is loaded. With `record`
    the config goes into run_dir/config.yaml once the feature store has accepted this harvest (a refused one
    changes nothing)."""
    t0 = time.time()
    h = cfg.harvest
    run_dir = Path(run_dir)
    check_harvest_config(h)
    spec = drafter_spec(cfg.drafter, resolve_path)
    dflash = isinstance(spec, DFlashConfig)  # no draft vocabulary: it drafts over the target's through its LM head
    for src in h.sources:
        check_source(src)
    frozen = vocab_from_drafter(resolve_path(cfg.drafter.init)) if cfg.drafter.init and not dflash else None
    if frozen is not None:
        check_vocab(*frozen, spec.vocab_size, frozen[0].numel())  # a warm start may grow it (train/build.py)

    chat = ChatFormat(load_tokenizer(cfg.target), cfg.target.chat_template)
    for src in h.sources:
        if src.kind == "tokens":  # its ids are taken as they are: they must be this tokenizer's
            check_tokenizer(check_source(src), chat.tokenizer)
    target = open_target(cfg.target, cfg.harvest, spec)
    info = target.info

    def prompt_fits(messages: list[dict]) -> str | None:
        """The prompt of the last turn, before any answer is written, must fit max_prompt_tokens."""
        prompt = [m for m in messages if m["role"] != "assistant"] if h.regenerate else messages[:-1]
        return (
            "too_long_prompt" if len(chat.encode(prompt, add_generation_prompt=True)[0]) > h.max_prompt_tokens else None
        )

    convs, prompt_skips = conversations(h, prompt_fits, h.regenerate)

    identity = {
        "name": info.name,
        "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size,
        "num_layers": info.num_layers,
        "aux_layer_ids": list(info.aux_layer_ids),
    }
    if dflash:  # aux_hidden holds the outputs of layers aux_layer_ids (K chunks), at these hidden_states indices
        identity["capture"] = {"kind": "dflash", "hidden_states": spec.hidden_state_indices()}
    features_dir = RunDir(run_dir).features
    writer = FeatureWriter(
        features_dir, identity, h.topk, h.store_last_hidden, fingerprint(h, cfg.target, cfg.seed, convs), h.aux_dtype
    )
    if damaged := writer.drop_damaged():
        print(
            f"harvest: {features_dir}: {len(damaged)} committed shard(s) damaged or missing "
            f"({'; '.join(damaged[:3])}{'; ...' if len(damaged) > 3 else ''}): their chunks are harvested again",
            file=sys.stderr,
            flush=True,
        )
    if record:
        save_resolved(cfg, run_dir, "harvest")
    sampling = Sampling(temperature=h.temperature, top_p=h.top_p, topk=h.topk, last_hidden=h.store_last_hidden)
    job = HarvestJob(target, chat, h, sampling, cfg.seed)

    chunks = []
    for split in SPLITS:
        members = [c for c in convs if c.split == split]
        chunks += [
            (split, i // h.shard_samples, members[i : i + h.shard_samples])
            for i in range(0, len(members), h.shard_samples)
        ]
    todo = [(s, i, m) for s, i, m in chunks if i not in writer.done(s)]
    row_check, row_layer = row_checker(h.aux_row_check, target, cfg.target, info.aux_layer_ids, info.hidden_size)
    run_stats = ChunkStats()
    t_work = time.time()
    with tqdm(
        total=len(convs),
        initial=len(convs) - sum(len(m) for _, _, m in todo),
        unit="sample",
        desc="harvest",
        file=sys.stderr,
        dynamic_ncols=True,
    ) as bar:

        def on_batch(n_samples: int, n_tokens: int) -> None:
            run_stats.captured_tokens += n_tokens
            bar.update(n_samples)
            bar.set_postfix(tok_s=f"{run_stats.captured_tokens / max(time.time() - t_work, 1e-9):.0f}")

        for split, index, members in todo:
            samples, stats = harvest_chunk(job, members, on_batch, row_check)
            check_argmax_rate(writer.manifest, stats.argmax, h, f"{split} chunk {index}")
            check_aux_rows(writer.manifest, stats.rows, f"{split} chunk {index}", row_layer)
            counts = {"argmax_check": {k: stats.argmax[k] for k in ("checked", "mismatched", "ties")}}
            counts = counts if stats.argmax else {}
            if stats.rows:
                counts["aux_rows"] = {k: stats.rows[k] for k in ("before", "here", "after")}
            writer.commit(split, index, samples, dict(stats.skips), counts or None)
            run_stats.generated_tokens += stats.generated_tokens
            run_stats.unfinished_answers += stats.unfinished_answers
    work_s = time.time() - t_work

    counts = masked_token_counts(features_dir, info.vocab_size)
    m = writer.manifest
    skips = Counter(prompt_skips) + Counter(m.get("chunk_skips", {}))
    writer.finish(counts, {"skips": dict(sorted(skips.items())), "prompt_skips": dict(sorted(prompt_skips.items()))})
    vocab = None
    if not dflash:
        d2t, t2d = frozen if frozen is not None else build_vocab(counts, spec.draft_vocab_size)
        save_vocab(RunDir(run_dir).vocab, d2t, t2d)
        vocab = {
            "size": int(d2t.numel()),
            "source": "drafter.init" if frozen is not None else "token counts",
            "loss_tokens_covered": round(float(counts[t2d].sum()) / max(int(counts.sum()), 1), 4),
        }

    disk = sum((features_dir / s["file"]).stat().st_size for s in m["shards"])
    tokens = sum(m["counts"][s]["tokens"] for s in SPLITS)
    summary = {
        "samples": {s: m["counts"][s]["samples"] for s in SPLITS},
        "tokens": tokens,
        "loss_tokens": sum(m["counts"][s]["loss_tokens"] for s in SPLITS),
        "bytes": disk,
        "bytes_per_token": round(disk / max(tokens, 1), 1),
        "skips": dict(sorted(skips.items())),
        "skipped_at": dict(sorted(prompt_skips.at.items())),  # the prompt records skipped: their file:line
        "chunks": len(chunks),
        "chunks_resumed": len(chunks) - len(todo),
        "this_run": {
            "generated_tokens": run_stats.generated_tokens,
            "captured_tokens": run_stats.captured_tokens,
            "unfinished_answers": run_stats.unfinished_answers,
            "harvest_s": round(work_s, 2),
            "captured_tokens_per_s": round(run_stats.captured_tokens / max(work_s, 1e-9), 1),
        },
        "draft_vocab": vocab,  # null for a DFlash drafter (the target's vocabulary)
        "argmax_check": (
            {
                "checked": 0,
                "mismatched": 0,
                "ties": 0,
                **m.get("chunk_counts", {}).get("argmax_check", {}),
                "tie_eps": h.argmax_tie_eps,
                "max_mismatch": h.argmax_max_mismatch,
            }
            if h.temperature == 0
            else "off (temperature > 0)"
        ),
        "aux_row_check": (
            {"before": 0, "here": 0, "after": 0, **m.get("chunk_counts", {}).get("aux_rows", {}), "lens": row_layer}
            if row_check is not None
            else row_layer
        ),
        "target": identity,
        "topk": h.topk,
        "time_s": round(time.time() - t0, 2),
    }
    write_json(features_dir / "summary.json", summary)
    return summary


def main(argv: list[str] | None = None) -> None:
    from eagle3ft.targets.sglang_http import SGLangError

    def work(cfg: Config, run_dir: Path) -> dict:
        return run_harvest(cfg, run_dir, record=True)

    errors = (StoreError, SGLangError, HarvestRefused)
    run_stage("Harvest target features for EAGLE-3 training.", "harvest", work, *errors, argv=argv)


if __name__ == "__main__":
    main()
