"""The report a newcomer reads: which prompts each tau comes from, the attempts behind each a_k, a plain verdict,
draft tokens explained, out-of-reach tau, the training-batch estimate apart from held-out tau, and the calibrated
prediction against the measured figure. Synthetic run folders: no model is loaded."""

import json

import pytest

from eagle3ft.config import load_config
from eagle3ft.eval.economics.calibration import calibration_from_summary
from eagle3ft.eval.report.build import build, verdict


def _spread(xs):
    return {"median": sorted(xs)[len(xs) // 2], "min": min(xs), "max": max(xs), "per_repetition": xs}


def _depths(attempts, accepts):
    rows, run = [], 1.0
    for k, (n, a) in enumerate(zip(attempts, accepts), start=1):
        run *= a / n
        rows.append(
            {
                "depth": k,
                "attempts": float(n),
                "accepts": float(a),
                "a_k": a / n,
                "reach_prob": run,
                "acc_k_unconditional": a / n * 0.9,
                "chains": 160,
            }
        )
    return rows


def accept_len_doc(attempts=(156, 18, 3), accepts=(18, 3, 1)):
    g = _depths(attempts, accepts)
    tau = 1 + sum(r["reach_prob"] for r in g)
    return {
        "steps": 3, "topk": 1, "num_draft_tokens": 4, "temperature": 1.0, "samples": 4, "roots": 156,
        "greedy": {"tau": tau, "per_depth": g}, "sampled": {"tau": tau, "temperature": 1.0, "per_depth": g},
        "tree": None,
        "settings": {"1/1/2": {"tau": 1 + g[0]["reach_prob"], "kind": "chain"},
                     "2/1/3": {"tau": 1 + g[0]["reach_prob"] + g[1]["reach_prob"], "kind": "chain"},
                     "3/1/4": {"tau": tau, "kind": "chain"}},
        "headline_tau": tau, "headline": "chain greedy", "checkpoint": "runs/demo/export",
        "data": {"features": "runs/demo/features", "split": "heldout", "samples_in_split": 4, "heldout_fraction": 0.05,
                 "sources": [{"kind": "mtbench", "path": None, "limit": 4, "split": "heldout"}]},
    }  # fmt: skip


def summary_doc(base_tok_s=18.0, rows=(("2/1/3", 1.10, 12.0, 0.090), ("3/1/4", 1.13, 12.6, 0.0897))):
    spec = []
    for key, tau, tok_s, cycle in rows:
        st, tk, n = map(int, key.split("/"))
        spec.append({
            "setting": {"steps": st, "topk": tk, "num_draft_tokens": n}, "key": key,
            "tok_s": _spread([tok_s * 0.98, tok_s, tok_s * 1.01]),
            "tok_s_median": tok_s, "speedup_median": tok_s / base_tok_s, "tau": tau, "verify_count": 170,
            "speedup_paired": _spread([0.69, 0.72, 0.71]),
            "accept_histogram": {"1": 150, "2": 20},
            "verify_ms": cycle * 700, "draft_forward_ms": cycle * 100, "cycle_s": cycle, "cycle_s_per_pass": cycle,
            "outputs_match_baseline": 1.0,
        })  # fmt: skip
    return {
        "backend": "embedded",
        "environment": {"device": "cpu: test", "torch": "2.11", "transformers": "5.17", "torch_threads": 1,
                        "load_average": [1.0]},
        "prompts": {"source": {"kind": "mtbench", "path": None, "limit": 2, "split": "auto"}, "count": 2,
                    "tokens": [40, 50]},
        "max_new_tokens": 32, "repetitions": 3, "temperature": 0.0,
        "baseline": {"tok_s": _spread([17.5, base_tok_s, 18.3]), "tok_s_median": base_tok_s,
                     "ms_per_token": 1e3 / base_tok_s},
        "costs": {"baseline_s_per_token": 1 / base_tok_s, "verify_s": {"3": 0.060, "4": 0.062},
                  "draft_forward_s": 0.012, "overhead_s": 0.0,
                  "source": "verify forwards timed inside the benchmark runs"},
        "speculative": spec,
    }  # fmt: skip


def _write(path, doc):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))


@pytest.fixture
def full_run(tmp_path):
    run = tmp_path / "run"
    phases = {"between": 0.004, "forward": 0.06, "backward": 0.12, "optimizer": 0.03}
    train = [
        {
            "step": s,
            "loss": 5.0 - s / 10,
            "acc": [0.1 + s / 100, 0.05],
            "accept_len_est": 1.1 + s / 100,
            "tokens": 2048,
            "tokens_per_s": 9000.0 + s if s > 1 else 500.0,  # the first step carries the warm-up
            "s_per_step": 2048 / (9000.0 + s) if s > 1 else 4.0,
            "phase_s": {k: v * (s if k == "between" else 1) for k, v in phases.items()},
        }
        for s in range(1, 41)
    ]
    held = {
        s: {"heldout_tau": t, "heldout_cond_acc": [0.1], "heldout_tokens": 1234}
        for s, t in ((10, 1.05), (20, 1.12), (30, 1.16), (40, 1.13))
    }
    recs = [{**m, **held.get(m["step"], {})} for m in train]  # train/loop.py adds held-out tau to the step's record
    recs += [{"step": 20, "heldout_tau": 1.12, "heldout_tokens": 1234}]  # or a record of its own: both are read
    _write(run / "train" / "metrics.jsonl", "\n".join(json.dumps(x) for x in recs) + "\n")
    _write(run / "eval" / "accept_len.json", {**accept_len_doc(), "checkpoint": str(run / "export-best")})
    _write(run / "bench" / "summary.json", summary_doc())
    _write(run / "export" / "card.json", {"which": "last", "step": 40, "heldout_step": 40, "heldout_tau": 1.13})
    _write(run / "export-best" / "card.json", {"which": "best", "step": 30, "heldout_step": 30, "heldout_tau": 1.16})
    return run


def test_report_reads_as_a_newcomer_needs(full_run):
    rep = build(full_run)
    md = (full_run / "eval" / "report.md").read_text()
    # which prompts and how many tokens behind each tau
    assert (
        "held-out split of runs/demo/features — 4 conversations (sources: mtbench, first 4, split heldout), 156 roots"
        in md
    )
    assert (
        "2 prompts of bench.prompts (mtbench, first 2; the first user turn), up to 32 new tokens each, 3 interleaved "
        "repetitions" in md
    )
    # the speed-up of the medians, then each repetition's own (paired); verifies (tokens = tau x verifies)
    assert "| 3/1/4 | 12.6 (12.3-12.7) | 0.70 (0.71) | 1.13 | 170 (192) |" in md
    # the attempts behind each a_k: the chain's conditional denominators, not the chains in the data
    assert "| 1 | 156 | 18 | 0.115 |" in md and "| 2 | 18 | 3 | 0.167 |" in md and "| 3 | 3 | 1 | 0.333 |" in md
    # a plain verdict, draft tokens explained
    assert rep["headline"]["break_even_tau"] == pytest.approx(
        (3 * 0.012 + 0.062) * 18.0
    )  # cycle 98 ms over a 55.6 ms step
    assert (
        rep["verdict"]
        == "τ 1.13 is below the break-even 1.76 at 3/1/4, so speculation is 30% slower than plain decoding (12.6 "
        "against 18.0 tok/s)."
    )
    assert f"**Verdict:** {rep['verdict']}" in md
    assert "3/1/4 drafts 3 tokens and verifies 4 positions" in md and "`--speculative-num-draft-tokens`" in md
    # out of reach: x2.0 (36 tok/s) needs tau 36 x 0.084 s = 3.02 at 2/1/3, whose tau is at most 3
    row = next(line for line in md.splitlines() if line.startswith("| 2/1/3 | 3 |"))
    assert row == "| 2/1/3 | 3 | 1.51 | 2.27 | 3.02: out of reach, needs 3/1/4 |"
    # the training-batch estimate labelled apart from held-out tau
    assert (
        "Training-batch τ estimate (`accept_len_est`): 1.50 at step 40, over the 2,048 tokens of the batches" in md
        and "not the held-out τ below" in md
    )
    assert "last 1.130 at step 40, best 1.160 at step 30" in md and "| 30 | 1.160 (best) | 1.40 |" in md
    assert (
        "- `export/`: the last step, what SGLang is pointed at by default: step 40, held-out τ 1.130 at step 40." in md
    )
    assert (
        "- `export-best/`: the best step by held-out τ: step 30" in md and "export-best (best export, step 30)." in md
    )
    assert rep["train"]["steps"] == 40  # held-out records do not replace the training records of their step
    # where the steps' time went: medians over steps 2-40 (step 1's warm-up left out)
    assert (
        "Speed (median of 39 logged steps after the first): 9,021 tokens/s, 227.0 ms per step: between 84.0 ms, "
        "forward 60.0 ms, backward 120.0 ms, optimizer 30.0 ms." in md
    )
    for name in ("train_loss", "accept_per_depth", "tau_offline_vs_live", "tok_s_vs_draft_tokens"):
        assert (full_run / "eval" / rep["plots"][name]).stat().st_size > 10_000


def test_verdict_says_faster_and_when_no_drafter_can_pay():
    h = {
        "tau_live": 2.6,
        "break_even_tau": 2.0,
        "speedup": 1.25,
        "setting": "3/1/4",
        "speculative_tok_s": 100.0,
        "baseline_tok_s": 80.0,
        "max_tau": 4,
    }
    assert (
        verdict(h)
        == "τ 2.60 is above the break-even 2.00 at 3/1/4, so speculation is 25% faster than plain decoding (100.0 "
        "against 80.0 tok/s)."
    )
    h2 = {**h, "tau_live": 1.9, "break_even_tau": 3.4, "speedup": 0.5, "setting": "2/1/3", "max_tau": 3}
    assert verdict(h2).endswith("No drafter can pay at 2/1/3: its τ is at most 3.")
    h3 = {**h, "speedup": 0.9}  # tau above the break-even, yet slower: the costs moved
    assert "yet, measured, speculation is 10% slower" in verdict(h3)
    assert verdict({"tau_offline": 1.5}) is None


def test_calibrated_prediction_before_and_after_the_bench(tmp_path):
    a = tmp_path / "a"
    _write(a / "bench" / "calibration.json", calibration_from_summary(summary_doc(), str(a)))
    cfg = load_config("configs/tiny.yaml", [f"bench.calibration={a / 'bench' / 'calibration.json'}"])
    b = tmp_path / "b"
    _write(b / "eval" / "accept_len.json", accept_len_doc(accepts=(120, 14, 2)))
    rep = build(b, cfg.eval, cfg.bench)
    assert (
        rep["verdict"].startswith("Predicted (no live benchmark yet): offline τ") and f"costs of {a}" in rep["verdict"]
    )
    md = (b / "eval" / "report.md").read_text()
    assert "no bench/summary.json: no measured costs" in md and "Predicted from offline τ alone" in md
    _write(b / "bench" / "summary.json", summary_doc(rows=(("3/1/4", 1.9, 20.0, 0.092),)))
    rep = build(b, cfg.eval, cfg.bench)
    (row,) = [r for r in rep["economics"]["calibrated"]["rows"] if r["setting"] == "3/1/4"]
    tau = rep["accept_len"]["settings"]["3/1/4"]["tau"]
    assert row["predicted_tok_s"] == pytest.approx(tau / 0.0897) and row["error_pct"] == pytest.approx(
        100 * (tau / 0.0897 - 20) / 20
    )
    md = (b / "eval" / "report.md").read_text()
    assert f"| 3/1/4 | {tau:.2f} | 89.70 (measured) | {tau / 0.0897:.1f}" in md and f"{row['error_pct']:+.1f}%" in md
