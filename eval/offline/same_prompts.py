"""Offline accept length on the benchmark's own prompts and answers: offline and live tau on the same tokens.

The bench's plain greedy pass gives the target's own answer to each prompt. One target forward over
prompt + answer gives what a harvest would store for it (the aux layers' hidden states, the top-k
log-probs of the next token), and eval/offline/accept_len.py's chain evaluation on those features is the
offline tau of exactly the tokens the live runs decoded. The offline tau averages over every answer token; the live
one starts a cycle only where the previous one ended, which the cycle walk's tau (`settings_walk`) follows
(eval/offline/acceptance.py). Where the two backends compute the same numbers, the walk equals the live tau.

As a command, the offline tau of `eval.checkpoint` on another bench run's plain answers, before any bench of that
drafter (the prediction's input when the answers are a calibration run's, eval/economics/analysis.py):

    python eval/offline/same_prompts.py --config CFG --run-dir RUN --answers-from CALIBRATION_RUN --set eval.checkpoint=D

With `--answers-of 3/1/4`, on that run's speculative answers at 3/1/4 instead: after a drafter's own bench, its
offline tau on the tokens its live tau was counted on.

The bench config (`bench.prompts`, `bench.settings`) must be the one CALIBRATION_RUN ran with; the result goes to
RUN/eval/accept_len.json, where eval/economics/analysis.py reads offline tau.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3ft.cli import build_parser, cli_errors, command_name, error_log, parse_cli
from eagle3ft.config import EvalConfig, TargetConfig
from eagle3ft.data.render import load_prompts, set_labels
from eagle3ft.data.store import check_run_drafter
from eagle3ft.drafter.folder import DrafterFolder
from eagle3ft.eval.decode.speculate import aux_from_hidden_states
from eagle3ft.eval.offline.accept_len import evaluate
from eagle3ft.eval.runs import first_answers
from eagle3ft.files import json_text, read_json, write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.runlock import holding
from eagle3ft.setting import Setting
from eagle3ft.targets.hf import load_target, load_tokenizer


@torch.no_grad()
def features(
    model, aux_layer_ids: list[int], prompt: list[int], answer: list[int], topk: int = 16, emitted: bool = False
) -> dict:
    """A store-like item: input_ids (T,), loss_mask (T,) 1 on the answer, aux_hidden (T, 3H), topk ids/log-probs (T,
    topk); `disagree` (T-1,) bool: where this model's argmax is not the next token of prompt + answer.

    With `emitted`, the greedy reference at every position is the token that follows it in prompt + answer (what the
    engine that wrote the answer emitted there) instead of this model's own argmax: a drafted token is accepted when
    it equals the emitted one, so another engine's near-tie flips do not count against the drafter."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + answer], device=device)  # (1, T)
    out = model(input_ids=ids, output_hidden_states=True)
    lp = F.log_softmax(out.logits[0].float(), dim=-1).topk(topk, dim=-1)  # (T, topk)
    mask = torch.zeros(ids.shape[1], dtype=torch.long, device=device)
    mask[len(prompt) :] = 1
    aux = aux_from_hidden_states(out.hidden_states, aux_layer_ids, model.config)[0]  # (T, 3H)
    top = lp.indices.clone()
    disagree = top[:-1, 0] != ids[0, 1:]  # (T-1,)
    if emitted:
        top[:-1, 0] = ids[0, 1:]
    return {
        "input_ids": ids[0],
        "loss_mask": mask,
        "aux_hidden": aux,
        "topk_ids": top,
        "topk_logprobs": lp.values,
        "disagree": disagree,
    }


def disagreement(items: list[dict], prompt_lens: list[int]) -> dict:
    """Where the scoring model's argmax differs from the emitted token, over the answer positions (the tokens after
    the first answer token's predecessor): their count, share, and the first few (sample, answer position)."""
    where, total = [], 0
    for i, (item, n) in enumerate(zip(items, prompt_lens)):
        d = item["disagree"][n - 1 :]  # position t predicts answer token t - n + 1
        total += int(d.numel())
        where += [(i, int(t)) for t in torch.nonzero(d).flatten().tolist()]
    return {
        "positions": total,
        "disagree": len(where),
        "share": len(where) / total if total else None,
        "first": where[:20],
    }


def offline_tau(
    model,
    drafter,
    aux_layer_ids: list[int],
    prompts: list[list[int]],
    answers: list[list[int]],
    settings: list[Setting],
    tree_context: str = "slots",
    emitted: bool = False,
) -> dict | None:
    """Greedy offline tau on these prompts and answers: every chain d/1/d+1 up to the deepest benchmarked chain, and
    each benchmarked tree (topk > 1) as SGLang builds it (eval/offline/acceptance.py's tree_accept, with tree_context).
    With `emitted`, scored against the answers' own tokens rather than `model`'s argmax (features)."""
    depth = max((s.steps for s in settings if s.topk == 1), default=0)
    trees = [s for s in settings if s.topk > 1]
    if depth == 0 and not trees:
        return None
    device = next(model.parameters()).device
    pairs = [(p, a) for p, a in zip(prompts, answers) if len(a) > 1]
    items = [features(model, aux_layer_ids, p, a, emitted=emitted) for p, a in pairs]
    rep = evaluate(drafter, iter(items), max(depth, 1), 1, max(depth, 1) + 1, 0.0, device)  # also counts the roots
    found = dict(rep.settings) if depth else {}
    for st in trees:  # one evaluation per tree: its own key only (its chain rows repeat the chain's)
        rep_tree = evaluate(drafter, iter(items), st.steps, st.topk, st.num_draft_tokens, 0.0, device, tree_context)
        found[st.key] = rep_tree.settings[st.key]
    return {
        "source": "the plain pass's greedy answers to the bench prompts",
        "samples": rep.samples,
        "roots": rep.roots,
        "settings": {k: v["tau"] for k, v in found.items()},
        "settings_walk": {k: v["tau_walk"] for k, v in found.items()},
        "settings_walk_interval": {k: v.get("tau_walk_interval") for k, v in found.items()},
        "settings_walk_loop_free": {k: v.get("tau_walk_loop_free") for k, v in found.items()},
        "loop_share": {k: v.get("loop_share_walk") for k, v in found.items()},
        "scored_against": "the emitted tokens" if emitted else "the scoring model's argmax",
        "disagreement": disagreement(items, [len(p) for p, _ in pairs]),
        **({"tree_context": tree_context} if trees else {}),
    }


def checkpoint_offline_tau(
    target: TargetConfig,
    ev: EvalConfig,
    folder: DrafterFolder,
    prompts: list[list[int]],
    answers: list[list[int]],
    settings: list[Setting],
    keep: list[bool] | None = None,
    emitted: bool = False,
) -> dict | None:
    """offline_tau of the drafter `folder` (eval.checkpoint, checked already), on a copy of `target` loaded here:
    what a bench backend without the target in this process (SGLang) uses. With `keep`, also on the answers it marks,
    as `rep["kept"]` (None when it marks none). With `emitted`, scored against the answers' own tokens, and against
    this copy's argmax too as `rep["argmax"]`: the gap between the two is what the engines' disagreement costs."""

    model, _ = load_target(target)
    drafter, aux_ids = folder.on_target(model)
    rep = offline_tau(model, drafter, aux_ids, prompts, answers, settings, ev.tree_context, emitted)
    if rep is not None and keep is not None:
        idx = [i for i, k in enumerate(keep) if k]
        sub = [prompts[i] for i in idx], [answers[i] for i in idx]
        rep["kept"] = offline_tau(model, drafter, aux_ids, *sub, settings, ev.tree_context, emitted) if idx else None
    if rep is not None and emitted:
        rep["argmax"] = offline_tau(model, drafter, aux_ids, prompts, answers, settings, ev.tree_context)
    return rep


def bench_answers(run: Path, label: str, count: int, setting: str | None = None) -> tuple[list[list[int]], list[bool]]:
    """The first repetition's greedy answers of prompt set `label` in the bench run `run`, by prompt index: the plain
    pass's, or with `setting` (a key such as "3/1/4") the speculative pass's, the tokens its live tau was counted on;
    and whether each finished (stopped on a stop id before the cap)."""
    runs, summary = RunDir(run).bench_runs, RunDir(run).bench_summary
    if not runs.is_file() or not summary.is_file():
        raise FileNotFoundError(f"--answers-from {run}: no finished bench there ({runs} and {summary} are needed)")
    if read_json(summary, "the bench summary").get("temperature") != 0:
        raise ValueError(f"--answers-from {run}: its bench was sampled; offline tau needs greedy (T=0) answers")
    rows = [json.loads(line) for line in runs.read_text().splitlines() if line.strip()]
    answers = first_answers(rows, label, setting)
    if sorted(answers) != list(range(count)):
        raise ValueError(
            f"--answers-from {run}: {setting or 'plain'} answers for prompts {sorted(answers)} of set {label!r}, "
            f"expected 0..{count - 1} (is bench.prompts the one that run used?)"
        )
    finished = first_answers([{**r, "output_ids": bool(r.get("finished"))} for r in rows], label, setting)
    return [answers[i] for i in range(count)], [finished[i] for i in range(count)]


def main(argv: list[str] | None = None) -> None:
    prog = command_name("same_prompts.py")  # in errors: the command the user typed

    desc = "Offline tau of eval.checkpoint on another bench run's greedy answers (RUN/eval/accept_len.json)."
    parser = build_parser(desc)
    parser.add_argument("--answers-from", required=True, help="a bench run folder whose greedy answers to use")
    parser.add_argument(
        "--answers-of",
        metavar="SETTING",
        help="that run's speculative answers at this setting (e.g. 3/1/4) instead of its plain ones: offline tau on "
        "the very tokens the live tau was counted on (on a GPU the two passes' bf16 answers part at near-ties)",
    )
    parser.add_argument(
        "--score",
        choices=("emitted", "argmax"),
        default="emitted",
        help="accept a drafted token when it equals the token the answer has there (emitted, the default: the serving "
        "engine's own choice) or this process's copy of the target's argmax (argmax); with emitted, the argmax figures "
        "and the positions where the two differ are reported beside",
    )
    # its run folder may be new: it holds this tool's output, the answers come from --answers-from
    cfg, run_dir, args = parse_cli(desc, stage="eval", argv=argv, parser=parser, read_side=False)
    with holding(run_dir, "eval", prog), cli_errors(prog, log=error_log(run_dir, "eval")):
        folder = check_run_drafter(DrafterFolder.of_run(run_dir, cfg.eval.checkpoint), RunDir(run_dir).features)
        label, src = set_labels(cfg.bench)[0]
        prompts = load_prompts(cfg.target, load_tokenizer(cfg.target), src)
        source = Path(args.answers_from)
        answers, finished = bench_answers(source, label, len(prompts), args.answers_of)
        # also on the answers that finished: a cap cut none of them, so no loop ran them long
        emitted = args.score == "emitted"
        rep = checkpoint_offline_tau(
            cfg.target, cfg.eval, folder, prompts, answers, cfg.bench.settings, keep=finished, emitted=emitted
        )
        if rep is None:
            raise ValueError("bench.settings is empty: nothing to evaluate")
        done, argmax = rep.pop("kept"), rep.pop("argmax", None)
        doc = {
            **rep,
            "source": f"the {args.answers_of or 'plain'} greedy answers of {source}/bench/runs.jsonl (repetition 0, "
            f"prompt set {label})",
            "checkpoint": str(folder.path),
            "settings": {
                k: {
                    "tau": v,
                    "tau_walk": rep["settings_walk"][k],
                    "tau_walk_interval": rep["settings_walk_interval"][k],
                    "tau_walk_loop_free": rep["settings_walk_loop_free"][k],
                    "loop_share_walk": rep["loop_share"][k],
                    "tau_walk_finished": done["settings_walk"][k] if done else None,
                    **({"tau_walk_argmax": argmax["settings_walk"][k]} if argmax else {}),
                }
                for k, v in rep["settings"].items()
            },
            "finished_answers": sum(finished),
        }
        out = RunDir(run_dir).accept_len
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, doc)
    what = {
        "offline_tau": rep["settings"],
        "walk": rep["settings_walk"],
        **({"walk_argmax": argmax["settings_walk"]} if argmax else {}),
        "disagreement": {k: v for k, v in rep["disagreement"].items() if k != "first"},
        "roots": rep["roots"],
        "written": str(out),
    }
    print(json_text(what, "same-prompt tau"))


if __name__ == "__main__":
    main()
