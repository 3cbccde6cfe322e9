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

from eagle3ft.eval.bench.summary import first_answers
from eagle3ft.eval.decode.speculate import aux_from_hidden_states
from eagle3ft.eval.offline.accept_len import evaluate
from eagle3ft.files import json_text, read_json, write_json
from eagle3ft.run_dir import RunDir
from eagle3ft.setting import Setting


@torch.no_grad()
def features(model, aux_layer_ids: list[int], prompt: list[int], answer: list[int], topk: int = 16) -> dict:
    """A store-like item: input_ids (T,), loss_mask (T,) 1 on the answer, aux_hidden (T, 3H), topk ids/log-probs (T,
    topk)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + answer], device=device)  # (1, T)
    out = model(input_ids=ids, output_hidden_states=True)
    lp = F.log_softmax(out.logits[0].float(), dim=-1).topk(topk, dim=-1)  # (T, topk)
    mask = torch.zeros(ids.shape[1], dtype=torch.long, device=device)
    mask[len(prompt) :] = 1
    aux = aux_from_hidden_states(out.hidden_states, aux_layer_ids, model.config)[0]  # (T, 3H)
    return {
        "input_ids": ids[0],
        "loss_mask": mask,
        "aux_hidden": aux,
        "topk_ids": lp.indices,
        "topk_logprobs": lp.values,
    }


def offline_tau(
    model,
    drafter,
    aux_layer_ids: list[int],
    prompts: list[list[int]],
    answers: list[list[int]],
    settings: list[Setting],
    tree_context: str = "slots",
) -> dict | None:
    """Greedy offline tau on these prompts and answers: every chain d/1/d+1 up to the deepest benchmarked chain, and
    each benchmarked tree (topk > 1) as SGLang builds it (eval/offline/acceptance.py's tree_accept, with tree_context)."""
    depth = max((s.steps for s in settings if s.topk == 1), default=0)
    trees = [s for s in settings if s.topk > 1]
    if depth == 0 and not trees:
        return None
    device = next(model.parameters()).device
    items = [features(model, aux_layer_ids, p, a) for p, a in zip(prompts, answers) if len(a) > 1]
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
        **({"tree_context": tree_context} if trees else {}),
    }


def checkpoint_offline_tau(
    cfg,
    run_dir: Path,
    prompts: list[list[int]],
    answers: list[list[int]],
    settings: list[Setting],
    keep: list[bool] | None = None,
) -> dict | None:
    """offline_tau of the drafter `eval.checkpoint` (checked against `run_dir`'s features when there are any), on a
    copy of `cfg.target` loaded here: what a bench backend without the target in this process (SGLang) uses. With
    `keep`, also on the answers it marks, as `rep["kept"]` (None when it marks none)."""
    from eagle3ft.config import resolve_path
    from eagle3ft.eval.bench.backend import check_drafter_for_run, drafter_on_target
    from eagle3ft.targets.hf import load_target

    folder = resolve_path(cfg.eval.checkpoint, base=run_dir)
    spec = check_drafter_for_run(folder, run_dir, "eval.checkpoint")
    model, _ = load_target(cfg.target)
    drafter, aux_ids = drafter_on_target(model, folder, spec)
    rep = offline_tau(model, drafter, aux_ids, prompts, answers, settings, cfg.eval.tree_context)
    if rep is not None and keep is not None:
        idx = [i for i, k in enumerate(keep) if k]
        sub = [prompts[i] for i in idx], [answers[i] for i in idx]
        rep["kept"] = offline_tau(model, drafter, aux_ids, *sub, settings, cfg.eval.tree_context) if idx else None
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
    from eagle3ft.cli import build_parser, cli_errors, error_log, parse_cli
    from eagle3ft.config import resolve_path
    from eagle3ft.eval.bench.prompts import load_prompts, set_labels
    from eagle3ft.runlock import holding
    from eagle3ft.targets.hf import load_tokenizer

    desc = "Offline tau of eval.checkpoint on another bench run's greedy answers (RUN/eval/accept_len.json)."
    parser = build_parser(desc)
    parser.add_argument("--answers-from", required=True, help="a bench run folder whose greedy answers to use")
    parser.add_argument(
        "--answers-of",
        metavar="SETTING",
        help="that run's speculative answers at this setting (e.g. 3/1/4) instead of its plain ones: offline tau on "
        "the very tokens the live tau was counted on (on a GPU the two passes' bf16 answers part at near-ties)",
    )
    # its run folder may be new: it holds this tool's output, the answers come from --answers-from
    cfg, run_dir, args = parse_cli(desc, stage="eval", argv=argv, parser=parser, read_side=False)
    with holding(run_dir, "eval", "same_prompts.py"), cli_errors("same_prompts.py", log=error_log(run_dir, "eval")):
        if not cfg.eval.checkpoint:
            raise ValueError("eval.checkpoint: name the drafter folder to evaluate")
        label, src = set_labels(cfg)[0]
        prompts = load_prompts(cfg, load_tokenizer(cfg.target), src)
        source = Path(args.answers_from)
        answers, finished = bench_answers(source, label, len(prompts), args.answers_of)
        # also on the answers that finished: a cap cut none of them, so no loop ran them long
        rep = checkpoint_offline_tau(cfg, run_dir, prompts, answers, cfg.bench.settings, keep=finished)
        if rep is None:
            raise ValueError("bench.settings is empty: nothing to evaluate")
        done = rep.pop("kept")
        doc = {
            **rep,
            "source": f"the {args.answers_of or 'plain'} greedy answers of {source}/bench/runs.jsonl (repetition 0, "
            f"prompt set {label})",
            "checkpoint": str(resolve_path(cfg.eval.checkpoint, base=run_dir)),
            "settings": {
                k: {
                    "tau": v,
                    "tau_walk": rep["settings_walk"][k],
                    "tau_walk_interval": rep["settings_walk_interval"][k],
                    "tau_walk_loop_free": rep["settings_walk_loop_free"][k],
                    "loop_share_walk": rep["loop_share"][k],
                    "tau_walk_finished": done["settings_walk"][k] if done else None,
                }
                for k, v in rep["settings"].items()
            },
            "finished_answers": sum(finished),
        }
        out = RunDir(run_dir).accept_len
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, doc)
    what = {"offline_tau": rep["settings"], "walk": rep["settings_walk"], "roots": rep["roots"], "written": str(out)}
    print(json_text(what, "same-prompt tau"))


if __name__ == "__main__":
    main()
