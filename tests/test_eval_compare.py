"""eagle3ft-compare on a hand-made pair of drafters whose τ per held-out set is known: each always drafts one token,
and each set's answers repeat one token, so a drafter accepts every draft on one set and none on the others."""

import json

import pytest
import torch
from train_fixtures import REPO, TINY_TARGET

from eagle3ft.data.store_writer import FeatureWriter, Sample
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.export import export_drafter
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.eval.offline import compare

TINY = REPO / "configs" / "tiny.yaml"
X, Y, W = 5, 7, 9  # the answers' tokens: the code set's, the chat set's, the other set's
ANSWER = 21  # answer tokens: the first is the prefill's, then 5 cycles of 3 accepted drafts + the bonus


def constant_drafter(folder, token: int) -> None:
    """A drafter that drafts `token` at every depth: attention and MLP write nothing, so its hidden state stays
    fc(aux) = ones (the store's aux states are ones), and lm_head's one non-zero row is the token's."""
    d = Eagle3Drafter(DrafterConfig.from_json(REPO / "configs/drafters/tiny.json"))
    d.t2d[: d.config.draft_vocab_size] = True  # d2t 0: draft id i is target id i
    with torch.no_grad():
        for p in d.parameters():
            p.zero_()
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
        d.fc.weight[:, 0] = 1.0
        d.lm_head.weight[token] = 1.0
    export_drafter(d, folder)


def write_heldout(run) -> None:
    """Two held-out conversations per set, prompts of 4 and 6 tokens, answers of one repeated token; the target's
    greedy next token is the stored one."""
    writer = FeatureWriter(run / "features", TINY_TARGET, 4, False, "hand-made")
    samples, sid = [], 0
    for name, token in (("code", X), ("chat", Y), ("other", W)):
        for prompt in (4, 6):
            ids = torch.tensor([11 + i for i in range(prompt)] + [token] * ANSWER)
            T = len(ids)
            nxt = torch.cat([ids[1:], ids[-1:]])
            topk = torch.stack([nxt, torch.full_like(nxt, 1), torch.full_like(nxt, 2), torch.full_like(nxt, 3)], -1)
            lp = torch.tensor([0.0, -30.0, -30.0, -30.0]).expand(T, 4)
            mask = torch.tensor([0] * prompt + [1] * ANSWER, dtype=torch.uint8)
            aux = torch.ones(T, 3 * TINY_TARGET["hidden_size"], dtype=torch.bfloat16)
            samples.append(Sample(sid, ids, mask, aux, topk, lp, source=name))
            sid += 1
    writer.commit("heldout", 0, samples, {})
    writer.finish(torch.zeros(TINY_TARGET["vocab_size"], dtype=torch.int64))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("compare")
    write_heldout(run)
    constant_drafter(run / "drafts-x", X)
    constant_drafter(run / "drafts-y", Y)
    (run / "bench").mkdir()
    (run / "bench" / "economics.json").write_text(
        json.dumps({"settings": [{"setting": "3/1/4", "break_even_tau": 1.8}]})
    )
    return run


def test_the_known_taus_give_the_known_lines(run, capsys):
    argv = ["--config", str(TINY), "--run-dir", str(run), "--before", str(run / "drafts-x"), "--after"]
    compare.main(argv + [str(run / "drafts-y")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (
        "verdict: gained chat +3.00 τ (+300.0% [+300.0%, +300.0%]); lost code -3.00 τ (-75.0% [-75.0%, -75.0%]); "
        "no clear change other +0.00 τ (+0.0% [+0.0%, +0.0%])"
    )
    rows = {line.split()[0]: line for line in lines[2:-1]}
    assert list(rows) == ["code", "chat", "other"]
    assert (
        rows["code"].split()
        == (
            "code 2 40 4.000 -> 1.000 -75.0% [-75.0%, -75.0%] 4.000 -> 1.000 -75.0% [-75.0%, -75.0%] 1.80 (after: loses)"
        ).split()
    )
    assert rows["chat"].split()[1:6] == ["2", "40", "1.000", "->", "4.000"] and rows["chat"].endswith("(after: wins)")
    res = json.loads((run / "eval" / "compare.json").read_text())
    code = res["sets"]["code"]
    assert code["tau"]["change"] == -3.0 and code["loop_free_tokens"] == 14  # 7 per answer before its loop
    assert res["per_sample"]["before"]["code"] == [[20, 5, 7.0, 1.75]] * 2


def test_a_drafter_against_itself_changes_nothing_and_costs_come_per_set(run, tmp_path):
    from eagle3ft.config import load_config

    (run / "bench" / "summary.json").write_text(
        json.dumps(
            {
                "prompt_sets": {
                    "code": {
                        "baseline": {"ms_per_token": 50.0},
                        "drafters": {"export": {"speculative": [{"key": "3/1/4", "cycle_s_per_pass": 0.1}]}},
                    }
                }
            }
        )
    )
    try:
        res = compare.run(load_config(TINY), run, str(run / "drafts-x"), str(run / "drafts-x"))
    finally:
        (run / "bench" / "summary.json").unlink()
    assert res["verdict"].startswith("verdict: no clear change code +0.00 τ (+0.0% [+0.0%, +0.0%]), chat +0.00 τ")
    assert res["sets"]["code"]["break_even"] == pytest.approx(2.0) and res["sets"]["chat"]["break_even"] == 1.8


def test_the_interval_is_over_the_conversations_drawn_again():
    before = compare.SetTotals([(10, 10, 10, 10), (10, 5, 10, 5)])  # τ 1 and 2 on its two conversations
    after = compare.SetTotals([(10, 5, 10, 5), (10, 5, 10, 5)])  # τ 2 on both
    c = compare.change(before, after, resamples=4000)
    assert c["tau"]["before"] == pytest.approx(20 / 15) and c["tau"]["after"] == 2.0
    lo, hi = c["tau"]["interval"]  # a draw of the first twice: +100%; of the second twice: 0%; of both: +50%
    assert lo == pytest.approx(0.0) and hi == pytest.approx(1.0)
    assert compare.verdict_line({"s": c}) == "verdict: no clear change s +0.67 τ (+50.0% [+0.0%, +100.0%])"
    with pytest.raises(ValueError, match="2 conversations before, 1 after"):
        compare.change(before, compare.SetTotals([(1, 1, 1, 1)]))
