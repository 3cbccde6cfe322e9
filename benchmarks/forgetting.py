"""Does a fine-tune on one domain cost the drafter what it knew, and do L2-SP and a replay mix keep it?

    python benchmarks/forgetting.py all --out runs/forgetting        # harvest, six fine-tunes, the verdicts, table
    python benchmarks/forgetting.py harvest|train|compare --out runs/forgetting [--arms plain,both]

On SmolLM2-135M-Instruct and the shipped drafter (configs/smollm2-135m.yaml), on the CPU:
- harvest (OUT/data): the target answers at T=0, at most 128 new tokens per answer and two user turns:
  HumanEval's first 40 problems (held out) and the other 124 (the domain's training part), everyday-v1's 120
  prompts and MT-Bench's 80 questions (held out: the general sets), and 96 ShareGPT conversations (training only:
  the replay, none sharing an 8-gram with a held-out set, `exclude_heldout`);
- train (OUT/<arm>): four fine-tunes of the shipped drafter on that store with the same steps, learning rate and
  seed: plain (the domain alone: the replay weighs 0), l2sp (train.l2sp), replay (the replay's weight draws a third
  of each epoch's answer tokens from it), both. λ comes from the plain fine-tune alone (`l2sp_lambda`), the replay
  weight from the store's answer tokens (`replay_weight`); OUT/params.json keeps both. Each arm's export is its
  last step: choosing a step on the held-out sets would tune on them. Two more arms need no plain run first:
  auto (the replay, and λ set by the run itself: train.l2sp auto) and guard (auto, plus train.guard: 24 replay
  conversations and 16 training problems set aside as validation splits, the export the best step on the
  problems among those whose τ on the conversations stays within 1% of the start's; the replay's weight then
  draws a third from the 72 replay conversations left);
- compare (OUT/<arm>/compare.json): eval/offline/compare.py, the shipped drafter against each arm's export on every
  held-out set: τ on all tokens and on the loop-free ones, the change and its 90% interval over the conversations;
  then the τ table per set and arm, and each arm against the goal (OUT/table.md, OUT/table.json), printed.
Every stage resumes: the harvest keeps its shards, a finished fine-tune (its export/) and a measured drafter's walk
(OUT/walks/) are not redone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "smollm2-135m.yaml"
SHIPPED = "drafters/smollm2-135m"
REPLAY_SHARE = 1 / 3  # of the answer tokens an epoch draws, in the replay arms
DOMAIN = "humaneval"
REPLAY = "replay"
ARMS = ("plain", "l2sp", "replay", "both", "auto", "guard")
GUARD = [  # the guard arm's validation splits, drawn out of the training sources (train/guard.py)
    f"train.guard.general_from={REPLAY}",
    "train.guard.general_samples=24",
    f"train.guard.domain_from={DOMAIN}",
    "train.guard.domain_samples=16",
    "train.heldout.eval_every=16",
    "train.heldout.eval_samples=8",  # the held-out sets are logged, not chosen on: a few of each is enough
]


def sources(replay_weight: float) -> str:
    """harvest.sources: the held-out sets, the domain's training part, and the replay with its training weight."""
    return (
        "harvest.sources=["
        "{kind: humaneval, limit: 40, split: heldout}, "
        "{kind: humaneval, split: train}, "
        "{kind: file, path: data/sets/everyday-v1.jsonl, split: heldout, name: everyday}, "
        "{kind: mtbench, split: heldout}, "
        f"{{kind: sharegpt, limit: 96, split: train, name: {REPLAY}, exclude_heldout: true, weight: {replay_weight}}}]"
    )


HARVEST = [
    "harvest.max_turns=2",
    "harvest.max_prompt_tokens=512",
    "harvest.max_total_tokens=768",
    "harvest.max_new_tokens=128",
    "harvest.batch_size=32",
    "harvest.shard_samples=64",
]
TRAIN = [
    "train.schedule.max_steps=128",  # about two epochs of the domain's 124 problems on 2 processes, the same for every arm
    "train.objective.ttt_steps=3",
    "train.optimizer.lr=3e-4",  # the demo's fine-tune
    "train.schedule.warmup_steps=8",
    "train.checkpoint.save_every=32",
    "train.batch.max_len=768",
    "train.heldout.eval_every=0",
    "train.logging.wandb_mode=disabled",
    "eval.steps=3",
    "eval.num_draft_tokens=4",
]


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, cwd=REPO, check=True, env=env)


def sets(overrides: list[str]) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def harvest(out: Path) -> None:
    cmd = [sys.executable, "data/harvest.py", "--config", str(CONFIG), "--run-dir", str(out / "data")]
    run(cmd + sets([sources(1.0), *HARVEST]))


def replay_weight(out: Path, guarded: bool = False) -> float:
    """The replay source's weight that draws REPLAY_SHARE of an epoch's answer tokens from it (the domain at 1); with
    `guarded`, of the samples the guard's validation splits leave to training."""
    from eagle3ft.config import load_config
    from eagle3ft.data.store import FeatureStore
    from eagle3ft.train.guard import validation_indices

    store = FeatureStore(out / "data" / "features", verify=False)
    ds, names = store.dataset("train", keys=("loss_mask",)), store.sources("train")
    drawn: set[int] = set()
    if guarded:
        cfg = load_config(CONFIG, GUARD)
        drawn = {i for idx in validation_indices(cfg.train.guard, names, cfg.seed).values() for i in idx}
    tokens = {REPLAY: 0, "other": 0}
    for i, (n, t) in enumerate(zip(names, ds.loss_tokens())):
        if i not in drawn:
            tokens[REPLAY if n == REPLAY else "other"] += t
    return REPLAY_SHARE / (1 - REPLAY_SHARE) * tokens["other"] / tokens[REPLAY]


def l2sp_lambda(out: Path) -> float:
    """λ from the plain fine-tune alone (its training loss and weights, no held-out figure): the penalty at the plain
    fine-tune's end, λ‖w − w0‖², equals the training loss it gained (the mean of its first 8 steps' losses less that
    of its last 16). Under gradient descent on a quadratic loss, L2-SP would then stop halfway along the line from w0
    to the plain weights; under Adam the pull is stronger wherever the data's gradient is weak."""
    from safetensors.torch import load_file

    rows = [json.loads(x) for x in (out / "plain" / "train" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    gain = sum(losses[:8]) / 8 - sum(losses[-16:]) / 16
    w, w0 = load_file(out / "plain" / "export" / "model.safetensors"), load_file(REPO / SHIPPED / "model.safetensors")
    drift = sum(float((w[k].double() - w0[k].double()).square().sum()) for k in w0 if w0[k].is_floating_point())
    return gain / drift


def arm_overrides(out: Path, arm: str) -> list[str]:
    params = json.loads((out / "params.json").read_text()) if (out / "params.json").is_file() else {}
    if arm in ("replay", "both", "auto") and "replay_weight" not in params:
        params["replay_weight"] = replay_weight(out)
    if arm == "guard" and "replay_weight_guarded" not in params:
        params["replay_weight_guarded"] = replay_weight(out, guarded=True)
    if arm in ("l2sp", "both") and "l2sp" not in params:
        params["l2sp"] = l2sp_lambda(out)
    (out / "params.json").write_text(json.dumps(params, indent=1) + "\n")
    weight = {"replay": 1, "both": 1, "auto": 1}.get(arm, 0) * params.get("replay_weight", 0.0)
    if arm == "guard":
        weight = params["replay_weight_guarded"]
    extra = {
        "l2sp": [f"train.l2sp={params.get('l2sp')}"],
        "both": [f"train.l2sp={params.get('l2sp')}"],
        "plain": ["train.l2sp=0"],
        "replay": ["train.l2sp=0"],
        "auto": ["train.l2sp=auto"],
        "guard": ["train.l2sp=auto", *GUARD],
    }[arm]
    return [sources(weight), *HARVEST, *TRAIN, *extra]


def train(out: Path, arm: str) -> None:
    run_dir = out / arm
    if (run_dir / "export" / "model.safetensors").is_file():
        print(f"done: {run_dir}/export", flush=True)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "features").exists():
        (run_dir / "features").symlink_to(Path("..") / "data" / "features")
    cmd = ["eagle3ft-train", "--accelerate-config", "configs/accelerate/cpu-2proc.yaml", "--config", str(CONFIG)]
    run(cmd + ["--run-dir", str(run_dir), "--resume", "auto", *sets(arm_overrides(out, arm))])


def compare_arms(out: Path, arms: tuple[str, ...]) -> dict:
    """Every arm's export against the shipped drafter on every held-out set (eval/offline/compare.py), the shipped drafter's
    walk measured once; each drafter's walk kept in OUT/walks/<label>.json."""
    from eagle3ft.config import load_config
    from eagle3ft.drafter.folder import DrafterFolder
    from eagle3ft.eval.offline import compare

    cfg = load_config(CONFIG, [sources(1.0), *HARVEST, *TRAIN])
    cache = out / "walks"
    cache.mkdir(exist_ok=True)
    folders = {"shipped": REPO / SHIPPED, **{arm: out / arm / "export" for arm in arms}}
    todo = {  # the drafters whose walk is not kept yet, each opened once
        k: DrafterFolder(v, f"{k}'s export") for k, v in folders.items() if not (cache / f"{k}.json").is_file()
    }
    if todo:
        for label, walk in compare.drafter_walks(cfg.eval, cfg.target, cfg.harvest, out / "data", todo).items():
            (cache / f"{label}.json").write_text(json.dumps({n: t.per_sample for n, t in walk.items()}) + "\n")
    walks = {
        k: {n: compare.SetTotals(v) for n, v in json.loads((cache / f"{k}.json").read_text()).items()} for k in folders
    }
    results = {}
    for arm in arms:
        res = compare.compare(walks["shipped"], walks[arm], ("shipped", arm), "3/1/4", {})
        (out / arm / "compare.json").write_text(json.dumps(res, indent=1) + "\n")
        results[arm] = res
        print(f"== {arm}\n{compare.format_table(res)}", flush=True)
    return results


def cell(t: dict) -> str:
    if t["interval"] is None:  # one conversation: compare gives no interval
        return f"{t['after']:.3f} ({100 * t['relative']:+.1f}%, one conversation)"
    lo, hi = t["interval"]
    return f"{t['after']:.3f} ({100 * t['relative']:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}])"


def goal(results: dict, names: list[str]) -> list[str]:
    """Per arm, against the goal: the domain gains at least the plain fine-tune's τ, and no general set loses more than
    1% of τ (all tokens; the point figure, its interval beside it)."""
    lines = ["**Against the goal** (domain gain ≥ plain's; each general set loses ≤ 1% of τ on all tokens):", ""]
    plain = results.get("plain", {}).get("sets", {}).get(DOMAIN, {}).get("tau", {}).get("relative")
    for arm, r in results.items():
        dom = r["sets"][DOMAIN]["tau"]["relative"]
        losses = {n: r["sets"][n]["tau"]["relative"] for n in names if n != DOMAIN}
        over = [n for n, x in losses.items() if x < -0.01]
        short = plain is not None and dom < plain
        general = ", ".join(f"{n} {100 * x:+.1f}%" for n, x in losses.items())
        verdict = (
            "meets it"
            if not over and not short
            else "misses it: "
            + "; ".join(
                ([f"domain below plain's {100 * plain:+.1f}%"] if short else []) + [f"{n} loses over 1%" for n in over]
            )
        )
        lines.append(f"- {arm}: {DOMAIN} {100 * dom:+.1f}%; {general}: {verdict}")
    return lines + [""]


def table(out: Path, results: dict) -> str:
    """The τ table: per held-out set, the shipped drafter's τ and each arm's, with the change and its interval."""
    first = next(iter(results.values()))
    names = [DOMAIN] + [n for n in first["sets"] if n != DOMAIN]
    params = json.loads((out / "params.json").read_text())
    lines = [
        f"Offline τ at 3/1/4 (greedy chain, the walk a live decoder makes), shipped drafter -> each fine-tune "
        f"(change, 90% interval over the conversations); λ {params.get('l2sp', 0):.4g}, replay weight "
        f"{params.get('replay_weight', 0):.3g} ({REPLAY_SHARE:.0%} of the answer tokens drawn).",
        "",
    ]
    for which, title in (("tau", "all tokens"), ("tau_loop_free", "loop-free tokens")):
        lines += [f"**τ on {title}**", "", "| set | conversations | shipped | " + " | ".join(results) + " |"]
        lines.append("|---|---|---|" + "---|" * len(results))
        for n in names:
            s = first["sets"][n]
            arms = " | ".join(cell(r["sets"][n][which]) for r in results.values())
            lines.append(f"| {n} | {s['conversations']} | {s[which]['before']:.3f} | {arms} |")
        lines.append("")
    lines += goal(results, names)
    text = "\n".join(lines)
    (out / "table.md").write_text(text)
    (out / "table.json").write_text(json.dumps({"params": params, "results": results}, indent=1) + "\n")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=("all", "harvest", "train", "compare"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of " + ", ".join(ARMS))
    a = ap.parse_args()
    arms = tuple(x for x in a.arms.split(",") if x)
    if unknown := set(arms) - set(ARMS):
        ap.error(f"--arms: unknown {sorted(unknown)}")
    if a.stage in ("all", "harvest"):
        harvest(a.out)
    if a.stage in ("all", "train"):
        for arm in arms:
            train(a.out, arm)
    if a.stage in ("all", "compare"):
        print(table(a.out, compare_arms(a.out, arms)))


if __name__ == "__main__":
    main()
