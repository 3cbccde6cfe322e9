"""Helpers of benchmarks/leases/sglang_vs_embedded.sh and benchmarks/leases/k2_rehearsal.sh (real SGLang on a GPU
against the embedded backend).

python benchmarks/sglang_target.py export-hf --config configs/smollm2-135m.yaml [--set k=v] --out DIR
    the configured target as an HF folder in bf16 that SGLang loads (no quantization_config)
python benchmarks/sglang_target.py seeded --config-json FOLDER/config.json --seed 0 --out DIR [--device cuda]
    a random target of that config.json, the same for the same seed, saved as an HF folder in bf16 (the K2
    rehearsal's weights: made where they are served, never carried); no tokenizer (SGLang --skip-tokenizer-init)
python benchmarks/sglang_target.py bigram --config-json FOLDER/config.json --emit 256 --gain 6 --branches 0.3,0.03
    how far the current token alone decides a shaped target's next one, per branch scale: greedy answers to seeded
    random prompts, and for each answer the share of its tokens that the most frequent successor of the current
    token in the other answers gets right (a drafter can learn from few answers only what holds across answers)
python benchmarks/sglang_target.py compare-stores RUN_A RUN_B [--out FILE] [--exclude-last]
    two feature stores of the same harvest (e.g. embedded vs SGLang): token agreement,
    aux_hidden error and cosine, top-k agreement; JSON to stdout (and FILE)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def export_hf(config: str, out: str, overrides: list[str] | None = None) -> None:
    from eagle3ft.config import load_config
    from eagle3ft.targets.hf import load_target

    cfg = load_config(config, overrides)
    cfg.target.device, cfg.target.dtype = "cpu", "float32"
    model, tok = load_target(cfg.target)
    out_dir = Path(out)
    # a GGUF load marks the model quantized, which save_pretrained refuses; the weights are dequantized already
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    conf = json.loads((out_dir / "config.json").read_text())
    conf.pop("quantization_config", None)  # SGLang would treat the folder as GGUF-quantized
    conf["torch_dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(conf, indent=2))
    print(
        json.dumps(
            {
                "out": str(out_dir),
                "hidden_size": conf["hidden_size"],
                "num_hidden_layers": conf["num_hidden_layers"],
                "vocab_size": conf["vocab_size"],
            }
        )
    )


BRANCHES = ("o_proj.weight", "down_proj.weight", "experts.down_proj")  # what every residual branch ends in


@torch.no_grad()
def scale_branches(model, factor: float) -> None:
    for name, p in model.named_parameters():
        if ".layers." in name and name.endswith(BRANCHES):
            p.mul_(factor)


def width_branch(hidden_size: int) -> float:
    """The branch scale at which a shaped target's answers are as predictable from the current token as at width 512
    and 0.3, where a drafter learns it (records 35f, 35h): a random branch's share of the residual stream grows about
    as the width, so the scale falls as 1/width above 512."""
    return min(0.3, 0.3 * 512 / hidden_size)


@torch.no_grad()
def make_learnable(model, emit: int, branch: float, gain: float, seed: int) -> None:
    """Shape a random target so that a drafter can learn it: every residual branch's output (attention's o_proj, the
    MLPs' and experts' down_proj) scaled by `branch`, so a position's last hidden state is mostly its own token's
    embedding; the head's rows of `emit` seeded token ids set to norm `gain` and every other row zeroed, so the target
    answers only in those ids and its next-token distribution is peaked. A drawn target's distribution is flat (every
    TTT step's loss sits at ln(draft vocab)), so no drafter gets past τ 1.00 on it."""
    scale_branches(model, branch)
    head = model.get_output_embeddings().weight  # (V, H)
    keep = torch.randperm(head.shape[0], generator=torch.Generator().manual_seed(seed))[:emit]
    mask = torch.zeros(head.shape[0], dtype=torch.bool)
    mask[keep] = True
    mask = mask.to(head.device)
    head[~mask] = 0
    rows = head[mask].float()
    head[mask] = (rows * (gain / rows.norm(dim=-1, keepdim=True))).to(head.dtype)  # logit std ~ gain after the norm


def seeded(
    config_json: str, seed: int, out: str, device: str = "cpu", emit: int | None = None, branch=None, gain=1.0
) -> dict:
    """A seeded random model of `config_json` in bf16, saved as `out` (model*.safetensors + config.json); with `emit`,
    shaped by make_learnable. The MoE experts are saved one tensor per expert (transformers reverts its fused layout on
    save), as SGLang loads them."""
    import time

    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    config = AutoConfig.from_pretrained(Path(config_json).parent)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    if branch is None:
        branch = width_branch(config.hidden_size)
    if emit:
        make_learnable(model, emit, branch, gain, seed)
    made = time.perf_counter() - t0
    model.save_pretrained(out)
    out_dir = Path(out)
    conf = json.loads((out_dir / "config.json").read_text())
    conf["torch_dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(conf, indent=2))
    return {
        "out": str(out_dir),
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "bytes": sum(f.stat().st_size for f in out_dir.glob("*.safetensors")),
        "seed": seed,
        "learnable": {"emit": emit, "branch": branch, "gain": gain} if emit else None,
        "device": device,
        "make_s": round(made, 1),
        "total_s": round(time.perf_counter() - t0, 1),
    }


def bigram_top1(answers: list[list[int]], draws: int = 2000, seed: int = 0) -> dict:
    """Leave one answer out: how often the other answers' most frequent successor of a token is the next one. Its
    spread: the 90% bootstrap interval over the answers (each draw resamples whole answers, the pairs and hits summed
    before the ratio), since the pairs inside one answer are not independent."""
    import random
    from collections import Counter, defaultdict

    hits, counts, seen = [], [], 0
    for k, answer in enumerate(answers):
        successors: dict[int, Counter] = defaultdict(Counter)
        for j, other in enumerate(answers):
            if j != k:
                for x, y in zip(other, other[1:]):
                    successors[x][y] += 1
        right = 0
        for x, y in zip(answer, answer[1:]):
            if x in successors:
                seen += 1
                right += successors[x].most_common(1)[0][0] == y
        hits.append(right)
        counts.append(max(len(answer) - 1, 0))
    pairs = sum(counts)
    rng, rates = random.Random(seed), []
    for _ in range(draws):
        pick = [rng.randrange(len(answers)) for _ in answers]
        n = sum(counts[i] for i in pick)
        if n:
            rates.append(sum(hits[i] for i in pick) / n)
    rates.sort()
    low, high = (rates[int(0.05 * (len(rates) - 1))], rates[int(0.95 * (len(rates) - 1))]) if rates else (None, None)
    return {
        "pairs": pairs,
        "current_seen": round(seen / pairs, 3),
        "bigram_top1": round(sum(hits) / pairs, 3),
        "bigram_top1_interval": [round(low, 3), round(high, 3)] if rates else None,
    }


@torch.no_grad()
def bigram(
    config_json: str, seed: int, emit: int, gain: float, branches: list[float], answers: int, new: int, device: str
) -> dict:
    """bigram_top1 of a seeded target shaped with each branch scale in turn (the same weights, the branches rescaled),
    on `answers` greedy answers of `new` tokens to seeded random prompts of 16 ids below 49,152 (SmolLM2's)."""
    import time

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(Path(config_json).parent)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    make_learnable(model, emit, 1.0, gain, seed)
    prompts = torch.randint(0, 49152, (answers, 16), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    out, scale = {"hidden_size": config.hidden_size, "emit": emit, "gain": gain, "runs": []}, 1.0
    for b in branches:
        scale_branches(model, b / scale)
        scale = b
        t0 = time.perf_counter()
        ids = model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None)
        got = [row[16:].tolist() for row in ids]
        s = round(time.perf_counter() - t0, 1)
        run = {"branch": b, **bigram_top1(got), "distinct_ids": len({t for a in got for t in a}), "s": s}
        out["runs"].append(run)
        print(json.dumps(run), flush=True)
    return out


def compare_stores(run_a: str, run_b: str, exclude_last: bool = False) -> dict:
    """exclude_last: leave each sample's final row out (one_request capture repeats row T-2 there)."""
    from eagle3ft.data.store import SPLITS, FeatureStore

    a, b = FeatureStore(Path(run_a) / "features"), FeatureStore(Path(run_b) / "features")
    out: dict = {"a": run_a, "b": run_b, "target_a": a.target, "target_b": b.target, "splits": {}}
    for split in SPLITS:
        da, db = a.dataset(split), b.dataset(split)
        by_id = {int(db[i]["sample_id"]): i for i in range(len(db))}
        n = same_ids = common_prefix = tokens = 0
        cos, rel, top1, topk_overlap, lp_err, by_chunk = [], [], [], [], [], []
        for i in range(len(da)):
            x = da[i]
            j = by_id.get(int(x["sample_id"]))
            if j is None:
                continue
            y = db[j]
            n += 1
            ia, ib = x["input_ids"], y["input_ids"]
            m = min(len(ia), len(ib))
            k = int((ia[:m] != ib[:m]).nonzero()[0]) if bool((ia[:m] != ib[:m]).any()) else m
            same_ids += int(torch.equal(ia, ib))
            common_prefix += k
            tokens += max(len(ia), len(ib))
            if exclude_last and k == m:
                k -= 1
            if k <= 0:
                continue
            ha, hb = x["aux_hidden"][:k].float(), y["aux_hidden"][:k].float()
            cos.append(torch.nn.functional.cosine_similarity(ha, hb, dim=-1))
            chunks = ha.shape[1] // a.target["hidden_size"]  # one per aux layer
            by_chunk.append(
                torch.nn.functional.cosine_similarity(
                    ha.unflatten(1, (chunks, -1)), hb.unflatten(1, (chunks, -1)), dim=-1
                )
            )
            rel.append((ha - hb).norm(dim=-1) / ha.norm(dim=-1).clamp_min(1e-6))
            ta, tb = x["topk_ids"][:k], y["topk_ids"][:k]
            top1.append((ta[:, 0] == tb[:, 0]).float())
            topk_overlap.append(
                torch.tensor([len(set(r.tolist()) & set(s.tolist())) / ta.shape[1] for r, s in zip(ta, tb)])
            )
            same = ta[:, 0] == tb[:, 0]
            lp_err.append((x["topk_logprobs"][:k, 0] - y["topk_logprobs"][:k, 0]).abs()[same])
        cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0)  # noqa: E731
        c, r, t1, ov, le = cat(cos), cat(rel), cat(top1), cat(topk_overlap), cat(lp_err)
        out["splits"][split] = {
            "samples": n,
            "identical_token_ids": same_ids,
            "common_prefix_token_share": round(common_prefix / max(tokens, 1), 4),
            "aux_cosine_mean": round(float(c.mean()), 5) if c.numel() else None,
            "aux_cosine_min": round(float(c.min()), 5) if c.numel() else None,
            # per aux layer's chunk, over its rows: the mean and the least
            "aux_cosine_mean_by_chunk": [round(float(v), 5) for v in torch.cat(by_chunk).mean(0)] if by_chunk else None,
            "aux_cosine_min_by_chunk": [round(float(v), 5) for v in torch.cat(by_chunk).min(0).values]
            if by_chunk
            else None,
            "aux_rel_err_median": round(float(r.median()), 5) if r.numel() else None,
            "aux_rel_err_p99": round(float(r.quantile(0.99)), 5) if r.numel() > 1 else None,
            "top1_agreement": round(float(t1.mean()), 5) if t1.numel() else None,
            "topk_overlap_mean": round(float(ov.mean()), 5) if ov.numel() else None,
            "top1_logprob_abs_err_median": round(float(le.median()), 5) if le.numel() else None,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export-hf")
    e.add_argument("--config", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--set", dest="overrides", action="append", default=[], help="dotted config override, repeatable")
    w = sub.add_parser("seeded")
    w.add_argument("--config-json", required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--out", required=True)
    w.add_argument("--device", default="cpu")
    w.add_argument("--emit", type=int, help="make_learnable: the ids the target answers in (default: as drawn)")
    w.add_argument(
        "--branch", type=float, help="make_learnable: residual branches' scale (default: width_branch of the width)"
    )
    w.add_argument(
        "--gain", type=float, default=4.0, help="make_learnable: the kept head rows' norm (the logits' spread)"
    )
    g = sub.add_parser("bigram")
    g.add_argument("--config-json", required=True)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--emit", type=int, default=256)
    g.add_argument("--gain", type=float, default=6.0)
    g.add_argument("--branches", default="0.3", help="comma-separated branch scales, tried in turn")
    g.add_argument("--answers", type=int, default=8)
    g.add_argument("--new", type=int, default=128, help="tokens per answer")
    g.add_argument("--device", default="cpu")
    g.add_argument("--out")
    c = sub.add_parser("compare-stores")
    c.add_argument("run_a")
    c.add_argument("run_b")
    c.add_argument("--out")
    c.add_argument(
        "--exclude-last", action="store_true", help="leave out each sample's final row (one_request capture)"
    )
    args = ap.parse_args()
    if args.cmd == "export-hf":
        export_hf(args.config, args.out, args.overrides)
    elif args.cmd == "seeded":
        print(json.dumps(seeded(args.config_json, args.seed, args.out, args.device, args.emit, args.branch, args.gain)))
    elif args.cmd == "bigram":
        branches = [float(b) for b in args.branches.split(",")]
        res = bigram(args.config_json, args.seed, args.emit, args.gain, branches, args.answers, args.new, args.device)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1))
    else:
        res = compare_stores(args.run_a, args.run_b, args.exclude_last)
        text = json.dumps(res, indent=1)
        if args.out:
            Path(args.out).write_text(text)
        print(text)


if __name__ == "__main__":
    main()
