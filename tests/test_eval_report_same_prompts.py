"""Offline tau on the bench's own prompts and answers: the features are what the harvest-side test helper builds,
and the tau is eval/offline/accept_len.py's on them, next to the live tau of the same greedy decodes."""

import json

import pytest
import torch
from _eval_tiny import AUX, features, greedy_items, prompts, tiny_pair

from eagle3ft.config import load_config
from eagle3ft.data.render import load_prompt_sets
from eagle3ft.eval.bench import schedule
from eagle3ft.eval.bench.backend import RequestResult
from eagle3ft.eval.decode.speculate import SpeculativeDecoder, greedy_decode
from eagle3ft.eval.offline.accept_len import evaluate
from eagle3ft.eval.offline.acceptance import SampleInputs, chain_accept_lengths, chain_acceptance, cycle_walk
from eagle3ft.eval.offline.same_prompts import bench_answers, offline_tau
from eagle3ft.eval.offline.same_prompts import features as bench_features
from eagle3ft.setting import Setting
from eagle3ft.targets.hf import load_tokenizer


def test_features_match_the_reference_item():
    target, _ = tiny_pair()
    (p,) = prompts(1, seed=5)
    answer = greedy_decode(target, p, 12).tokens
    got, ref = bench_features(target, AUX, p, answer), features(target, p + answer, len(p))
    for k in ("input_ids", "loss_mask", "topk_ids"):
        assert torch.equal(got[k], ref[k]), k
    for k in ("aux_hidden", "topk_logprobs"):  # float32 log-softmax here, float64 in the reference
        assert torch.allclose(got[k].double(), ref[k], atol=1e-5), k


def test_offline_tau_on_the_bench_answers_tracks_the_live_tau():
    target, drafter = tiny_pair()
    ps = prompts(6, seed=1)[:3]  # prompts the drafter was fitted on: drafts are accepted often
    answers = [greedy_decode(target, p, 24).tokens for p in ps]
    res = offline_tau(target, drafter, AUX, ps, answers, [Setting(1, 1, 2), Setting(3, 1, 4)])
    ref = evaluate(drafter, greedy_items(target, ps, 24), 3, 1, 4, 0.0)
    assert res["settings"] == {k: v["tau"] for k, v in ref.settings.items()} and res["roots"] == ref.roots == sum(
        len(a) - 1 for a in answers
    )
    dec = SpeculativeDecoder(target, drafter, AUX, 3)
    gens = [dec.generate(p, 24) for p in ps]
    live = sum(sum(g.accept_lengths) for g in gens) / sum(g.verify_count for g in gens)
    assert res["settings"]["3/1/4"] > 1.3  # the fitted drafter is accepted often: the comparison is not 1 against 1
    assert res["settings"]["3/1/4"] == pytest.approx(
        live, rel=0.05
    )  # same tokens; only the cycle roots (and the last, cut cycle) differ
    trees = offline_tau(target, drafter, AUX, ps, answers, [Setting(3, 1, 4), Setting(3, 2, 6), Setting(2, 3, 5)])
    for st in (Setting(3, 2, 6), Setting(2, 3, 5)):  # each tree as accept_len.py scores it alone, chains unchanged
        alone = evaluate(drafter, greedy_items(target, ps, 24), st.steps, st.topk, st.num_draft_tokens, 0.0)
        assert trees["settings"][st.key] == alone.settings[st.key]["tau"]
        assert trees["settings_walk"][st.key] == alone.settings[st.key]["tau_walk"]
    assert {k: trees["settings"][k] for k in res["settings"]} == res["settings"]
    assert set(trees["settings"]) == {*res["settings"], "3/2/6", "2/3/5"}  # no chain deeper than the deepest benched
    only = offline_tau(target, drafter, AUX, ps, answers, [Setting(3, 2, 6)])
    assert set(only["settings"]) == {"3/2/6"} and only["roots"] == res["roots"]
    assert offline_tau(target, drafter, AUX, ps, answers, []) is None


def test_the_cycle_walk_is_the_live_decoders_cycles():
    """Walking the offline per-root accept lengths cycle by cycle gives the live greedy decoder's accept length of
    every cycle on the same answer (all but the last, which max_new_tokens cuts), and so its tau."""
    target, drafter = tiny_pair()
    ps = prompts(6, seed=1)[:3] + prompts(2, seed=9)  # fitted-on prompts (long accepts) and others (rejections)
    for steps in (1, 3, 5):
        dec = SpeculativeDecoder(target, drafter, AUX, steps)
        live, walked = [], []
        for p in ps:
            gen = dec.generate(p, 24)
            res = chain_acceptance(drafter, SampleInputs.of(features(target, p + gen.tokens, len(p))), steps)
            cycles = cycle_walk(*chain_accept_lengths(res, steps))
            assert cycles[:-1] == gen.accept_lengths[:-1], (steps, p)
            assert 0 <= sum(cycles) - (len(gen.tokens) - 1) <= steps  # the last cycle may run past the answer
            live += gen.accept_lengths
            walked += cycles
        assert min(live) == 1 and max(live) == steps + 1  # both rejections and full accepts
    rep = offline_tau(target, drafter, AUX, ps, [greedy_decode(target, p, 24).tokens for p in ps], [Setting(3, 1, 4)])
    assert rep["settings_walk"]["3/1/4"] < rep["settings"]["3/1/4"]  # cycles start after rejections: harder roots


class _Backend:
    """A bench backend double: fixed answers per prompt and repetition, and a record of what offline_tau got."""

    name = "double"
    tokenizer = property(lambda self: load_tokenizer(load_config("configs/tiny.yaml").target))

    def __init__(self):
        self.rep, self.got = -2, None  # the untimed warm-up pass is -1, the timed repetitions 0, 1, ...

    def _results(self, prompts, spec, first):
        return [RequestResult(i, len(p), 5, 0.01, 0.04, output_ids=[100 + i, self.rep, 7, 8, 9],
                              verify_count=2 if spec else None, accept_lengths=[2, 2] if spec else None)
                for i, p in enumerate(prompts, first)]  # fmt: skip

    def run_baseline(self, prompts, max_new_tokens, first_index=0):
        self.rep += first_index == 0  # a repetition starts at the first prompt
        return self._results(prompts, False, first_index)

    def run_speculative(self, prompts, setting, max_new_tokens, first_index=0):
        return self._results(prompts, True, first_index)

    def offline_tau(self, prompts, answers, settings):
        self.got = (prompts, answers, [s.key for s in settings])
        return {"source": "double", "samples": len(prompts), "roots": 8, "settings": {"3/1/4": 1.9}}

    def environment(self):
        return {"device": "none"}


def _bench(cfg, run_dir, backend, log):
    """The bench's schedule on `backend` over the config's prompt sets, rendered with its tokenizer."""
    return schedule.run(
        cfg.eval, cfg.bench, run_dir, backend, load_prompt_sets(cfg.target, cfg.bench, backend.tokenizer), log=log
    )


def test_the_bench_scores_the_first_plain_pass_answers_offline(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["bench.prompts.limit=2", "bench.repetitions=2", "bench.max_new_tokens=5"])
    backend = _Backend()
    summary = _bench(cfg, tmp_path, backend, log=lambda *a: None)
    prompts, answers, keys = backend.got
    assert (
        answers == [[100, 0, 7, 8, 9], [101, 0, 7, 8, 9]] and len(prompts) == 2 and keys == ["3/1/4"]
    )  # repetition 0's
    assert summary["offline_same_prompts"]["settings"] == {"3/1/4": 1.9}
    cfg.bench.temperature = 0.7  # sampled answers are not the target's greedy path: not scored
    assert _bench(cfg, tmp_path, _Backend(), log=lambda *a: None)["offline_same_prompts"] is None


def test_answers_of_another_run_are_checked(tmp_path):
    with pytest.raises(FileNotFoundError, match="no finished bench"):
        bench_answers(tmp_path, "mtbench", 2)
    bench = tmp_path / "bench"
    bench.mkdir()
    rows = [
        {
            "repetition": r,
            "mode": m,
            "setting": None if m == "baseline" else "3/1/4",
            "prompts": "mtbench",
            "prompt_index": i,
            "output_ids": [10 * r + i, m == "baseline"],
            "finished": i == 1,
        }
        for r in (0, 1)
        for m in ("baseline", "speculative")
        for i in (0, 1)
    ]
    (bench / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (bench / "summary.json").write_text(json.dumps({"temperature": 0.7}))
    with pytest.raises(ValueError, match="sampled"):
        bench_answers(tmp_path, "mtbench", 2)
    (bench / "summary.json").write_text(json.dumps({"temperature": 0.0}))
    # the first repetition's plain pass, and which of its answers finished before the cap
    assert bench_answers(tmp_path, "mtbench", 2) == ([[0, True], [1, True]], [False, True])
    assert bench_answers(tmp_path, "mtbench", 2, "3/1/4") == ([[0, False], [1, False]], [False, True])  # speculative
    with pytest.raises(ValueError, match="5/1/6 answers for prompts"):
        bench_answers(tmp_path, "mtbench", 2, "5/1/6")
    with pytest.raises(ValueError, match="expected 0..2"):
        bench_answers(tmp_path, "mtbench", 3)
    with pytest.raises(ValueError, match="expected 0..1"):
        bench_answers(tmp_path, "humaneval", 2)


class _CountingBackend(_Backend):
    """The double, recording how many prompts each baseline and speculative pass got, in order."""

    def __init__(self):
        super().__init__()
        self.passes = []

    def run_baseline(self, prompts, max_new_tokens, first_index=0):
        self.passes.append(("baseline", len(prompts)))
        return super().run_baseline(prompts, max_new_tokens, first_index)

    def run_speculative(self, prompts, setting, max_new_tokens, first_index=0):
        self.passes.append((setting.key, len(prompts)))
        return super().run_speculative(prompts, setting, max_new_tokens, first_index)


@pytest.mark.parametrize("warmup, warm", [("all", 3), ("first", 1)])
def test_the_warm_up_runs_every_prompt_or_the_first_once_per_arm_untimed(tmp_path, warmup, warm):
    cfg = load_config(
        "configs/tiny.yaml",
        ["bench.prompts.limit=3", "bench.repetitions=2", f"bench.warmup={warmup}", "bench.interleave=pass"],
    )
    backend = _CountingBackend()
    _bench(cfg, tmp_path, backend, log=lambda *a: None)
    timed = [("baseline", 3), ("3/1/4", 3)] * 2
    assert backend.passes == [("baseline", warm), ("3/1/4", warm)] + timed
    rows = [json.loads(line) for line in (tmp_path / "bench" / "runs.jsonl").read_text().splitlines()]
    assert sorted({r["repetition"] for r in rows}) == [0, 1] and len(rows) == 12  # the warm-up is not recorded
    cfg.bench.warmup = "none"
    with pytest.raises(ValueError, match="bench.warmup 'none'"):
        _bench(cfg, tmp_path, backend, log=lambda *a: None)


def test_interleave_prompt_runs_every_arm_on_a_prompt_before_the_next_and_keeps_its_index(tmp_path):
    cfg = load_config(
        "configs/tiny.yaml",
        ["bench.prompts.limit=3", "bench.repetitions=2", "bench.warmup=first",
         "bench.settings=[{steps: 3, topk: 1, num_draft_tokens: 4}, {steps: 1, topk: 1, num_draft_tokens: 2}]"],
    )  # fmt: skip
    assert cfg.bench.interleave == "prompt"  # the default
    backend = _CountingBackend()
    summary = _bench(cfg, tmp_path, backend, log=lambda *a: None)
    per_prompt = [("baseline", 1), ("3/1/4", 1), ("1/1/2", 1)]
    assert backend.passes == [("baseline", 1), ("3/1/4", 1), ("1/1/2", 1)] + per_prompt * 3 * 2
    rows = [json.loads(line) for line in (tmp_path / "bench" / "runs.jsonl").read_text().splitlines()]
    assert len(rows) == 18  # one row per request: 3 prompts x 3 arms x 2 repetitions, each arm's prompts together
    for rep in (0, 1):
        for key in (None, "3/1/4", "1/1/2"):
            mine = [r for r in rows if r["repetition"] == rep and r["setting"] == key]
            assert [r["prompt_index"] for r in mine] == [0, 1, 2]
            assert [r["output_ids"][0] for r in mine] == [100, 101, 102]  # the double's answer to prompt i
            assert {r["output_ids"][1] for r in mine} == {rep}  # both repetitions are told apart
    assert summary["interleave"] == "prompt"
    for row in summary["speculative"]:  # the double's passes all take 0.04 s per request, plain or not
        assert row["speedup_paired"]["per_repetition"] == [1.0, 1.0]
        assert row["cycle_plain_steps"] == pytest.approx((0.04 / 2) / (0.04 / 4))  # 2 verifies vs 4 plain steps
    cfg.bench.interleave = "token"
    with pytest.raises(ValueError, match="bench.interleave 'token'"):
        _bench(cfg, tmp_path, backend, log=lambda *a: None)


def test_scored_against_the_emitted_tokens():
    """On the target's own greedy answers the emitted tokens are its argmax: both scorings agree and nothing differs.
    Where another engine emitted something else (one answer token replaced), that position is named as a
    disagreement, and scoring against the emitted token accepts what the drafter would have been accepted on live."""
    target, drafter = tiny_pair()
    ps = prompts(6, seed=1)[:3]
    answers = [greedy_decode(target, p, 24).tokens for p in ps]
    st = [Setting(3, 1, 4)]
    own = offline_tau(target, drafter, AUX, ps, answers, st, emitted=True)
    assert own["settings_walk"] == offline_tau(target, drafter, AUX, ps, answers, st)["settings_walk"]
    assert own["disagreement"]["disagree"] == 0 and own["disagreement"]["positions"] == sum(len(a) for a in answers)
    other = [list(a) for a in answers]
    other[1][5] = (other[1][5] + 1) % target.config.vocab_size  # what another engine's near-tie flip looks like
    emitted = offline_tau(target, drafter, AUX, ps, other, st, emitted=True)
    argmax = offline_tau(target, drafter, AUX, ps, other, st)
    assert emitted["disagreement"]["disagree"] >= 1 and (1, 5) in emitted["disagreement"]["first"]
    assert emitted["scored_against"] == "the emitted tokens"
    assert emitted["roots"] >= argmax["roots"]  # argmax scoring drops the roots past a token it would not have emitted
