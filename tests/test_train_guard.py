"""train.l2sp auto (λ set by the run from its own first steps) and train.guard (validation splits drawn out of the
training sources, and the export chosen on them)."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import REPO, launch, write_store

from eagle3ft.config import load_config
from eagle3ft.config_build import ConfigError
from eagle3ft.train.data import TrainData
from eagle3ft.train.guard import choose, validation_indices
from eagle3ft.train.l2sp import L2SP, SelfSetLambda, calibration_steps, self_set_lambda
from eagle3ft.train.run_state import lr_lambda

TINY = REPO / "configs/tiny.yaml"
SOURCES = "harvest.sources=[{kind: humaneval, name: code}, {kind: sharegpt, name: chat}]"


# --------------------------------------------------------------------------- λ that sets itself


def test_the_rule_balances_the_penalty_against_the_gain_at_the_extrapolated_end():
    lam, why = self_set_lambda(gain=1.0, drift=2.0, lr_window=0.5, lr_total=2.0)
    assert lam == pytest.approx(1.0 / (2.0 * 4.0**2))  # ‖w − w0‖² grows as (Σ lr)²: 2.0 x 16 at the end
    assert "gain 1" in why and "= 32 at the end" in why
    # the forgetting benchmark's plain run, balanced by hand at its end: gain 1.077, ‖w − w0‖² 266 -> λ 0.00405
    assert self_set_lambda(1.077, 266 / 15.6**2, 1.0, 15.6)[0] == pytest.approx(0.00405, rel=0.01)
    lam, why = self_set_lambda(-0.2, 2.0, 0.5, 2.0)
    assert lam == 0.0 and "gained no loss" in why
    lam, why = self_set_lambda(0.3, 0.0, 0.5, 2.0)
    assert lam == 0.0 and "did not move" in why


def test_the_calibration_window_is_the_warm_up_or_an_eighth_of_the_run():
    assert calibration_steps(64, 4) == 8 and calibration_steps(128, 20) == 20
    assert calibration_steps(4, 10) == 3 and calibration_steps(1, 0) == 0


class Toy(torch.nn.Module):
    """An engine stand-in: the loss of a batch is Σ (w − x)²."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))

    def forward(self, batch):
        return SimpleNamespace(loss=((self.w - batch["x"]) ** 2).sum())


def test_settle_sets_what_the_rule_computes_from_the_kept_micro_batches():
    torch.manual_seed(0)
    toy = Toy()
    opt = torch.optim.SGD(toy.parameters(), lr=0.1)
    l2sp = L2SP(0.0, list(toy.parameters()))
    l2sp.attach(opt)
    total, factor = 16, lambda s: min(1.0, (s + 1) / 4)
    auto = SelfSetLambda(total, 4, factor)
    batches = [{"x": torch.randn(3) + 1} for _ in range(4)]
    first = []
    for step, b in enumerate(batches):  # the window: 4 steps, its first half (2 steps) kept
        out = toy(b)
        auto.take(step, b, out.loss)
        first.append(float(out.loss.detach()))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        l2sp.end_step()
        assert l2sp.lam == 0.0 and auto.due(step + 1) == (step + 1 == 4)
    rec = auto.settle(toy, l2sp, lambda t: t, "cpu", 4)
    with torch.no_grad():
        gain = sum(first[i] - float(toy(batches[i]).loss) for i in range(2)) / 2
        drift = float((toy.w - 0).square().sum())
    s_w, s_t = sum(factor(s) for s in range(4)), sum(factor(s) for s in range(total))
    assert rec["probe_micro_batches"] == 2 and rec["loss_gain"] == pytest.approx(gain) and gain > 0
    assert rec["drift"] == pytest.approx(drift) and (rec["lr_sum_window"], rec["lr_sum_run"]) == (s_w, s_t)
    assert l2sp.lam == rec["lambda"] == pytest.approx(gain / (drift * (s_t / s_w) ** 2))
    assert not auto.pending and not auto.due(5)


def test_a_resume_restores_the_self_set_lambda_or_says_it_has_none():
    p = torch.nn.Parameter(torch.ones(2))
    l2sp, auto = L2SP(0.0, [p]), SelfSetLambda(16, 2, lambda s: 1.0)
    assert auto.restore({"lambda": 0.25, "step": 2}, l2sp, 5) is None and l2sp.lam == 0.25 and not auto.pending
    l2sp, auto = L2SP(0.0, [p]), SelfSetLambda(16, 2, lambda s: 1.0)
    note = auto.restore(None, l2sp, 5)
    assert "past the calibration window" in note and l2sp.lam == 0.0 and not auto.pending
    l2sp, auto = L2SP(0.0, [p]), SelfSetLambda(16, 2, lambda s: 1.0)
    assert auto.restore(None, l2sp, 1) is None and auto.pending  # inside the window: it calibrates from here


def test_auto_is_a_value_of_train_l2sp_and_a_number_still_wins():
    assert load_config(TINY, ["train.objective.l2sp=auto"]).train.objective.l2sp == "auto"
    assert load_config(TINY, ["train.objective.l2sp=0.5"]).train.objective.l2sp == 0.5
    assert load_config(REPO / "configs/smollm2-135m.yaml").train.objective.l2sp == "auto"
    for bad in ("often", "-1"):
        with pytest.raises(ConfigError, match="l2sp"):
            load_config(TINY, [f"train.objective.l2sp={bad}"])


# --------------------------------------------------------------------------- the guard's choice


H = [
    {"step": 0, "general": 2.0, "domain": 1.5},
    {"step": 2, "general": 1.99, "domain": 1.6},
    {"step": 4, "general": 1.95, "domain": 1.9},
    {"step": 6, "general": 1.985, "domain": 1.7},
]


def test_the_guard_picks_the_best_domain_step_among_those_within_the_bound():
    c = choose(H, 0.01)  # floor 1.98: steps 2 and 6 are within, step 4 (the best on the domain) is not
    assert c["step"] == 6 and not c["kept_start"] and c["floor"] == pytest.approx(1.98)
    assert c["steps_within_bound"] == [2, 6] and "step 6" in c["why"] and "within 1.0%" in c["why"]
    assert choose(H, 0.03)["step"] == 4


def test_the_guard_keeps_the_start_when_no_step_keeps_the_bound_and_says_so():
    c = choose([H[0], {"step": 2, "general": 1.9, "domain": 1.8}, {"step": 4, "general": 1.97, "domain": 2.0}], 0.01)
    assert c["step"] == 0 and c["kept_start"] and c["steps_within_bound"] == []
    assert "no trained step kept the general τ within 1.0%" in c["why"] and "1.9000 at step 2" in c["why"]
    c = choose([H[0], {"step": 2, "general": 2.0, "domain": 1.4}], 0.01)  # within, but no gain on the domain
    assert c["step"] == 0 and c["kept_start"] and "gained nothing on the domain" in c["why"]


def test_validation_splits_are_drawn_out_of_the_named_training_sources(tmp_path):
    write_store(tmp_path, n_train=12, n_heldout=4, sources={"train": ("code", "chat"), "heldout": ("code", "chat")})
    guard = [
        "train.guard.general_from=chat",
        "train.guard.general_samples=3",
        "train.guard.domain_from=code",
        "train.guard.domain_samples=2",
    ]
    data = TrainData(load_config(TINY, [SOURCES, *guard]), tmp_path)
    ids = {k: [int(ds[i]["sample_id"]) for i in range(len(ds))] for k, ds in data.validation.items()}
    trained = {int(data.dataset[i]["sample_id"]) for i in range(len(data))}
    # the store records train sample i under code, chat, code, ... (ids 0-11); held-out ids are 12-15
    assert len(ids["general"]) == 3 and all(i % 2 == 1 for i in ids["general"])
    assert len(ids["domain"]) == 2 and all(i % 2 == 0 for i in ids["domain"])
    assert len(trained) == 7 and not trained & set(ids["general"] + ids["domain"]) and max(trained) < 12
    assert set(data.sources) == {"code", "chat"} and data.mix["chat"]["samples"] == 3
    again = TrainData(load_config(TINY, [SOURCES, *guard]), tmp_path)
    assert [int(again.validation["general"][i]["sample_id"]) for i in range(3)] == ids["general"]  # seeded
    assert TrainData(load_config(TINY, [SOURCES]), tmp_path).validation == {}
    with pytest.raises(ValueError, match="'replay': no training sample .*training sources: chat, code"):
        validation_indices(load_config(TINY, ["train.guard.general_from=replay"]).train.guard, ["code", "chat"], 0)


# --------------------------------------------------------------------------- the trainer, end to end

COMMON = (
    SOURCES,
    "train.objective.ttt_steps=3",
    "train.checkpoint.save_every=100",
    "train.heldout.eval_samples=4",
)
GUARD = (
    "train.guard.general_from=chat",
    "train.guard.general_samples=4",
    "train.guard.domain_from=code",
    "train.guard.domain_samples=4",
    "train.heldout.eval_every=2",
)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> Path:
    """A drafter trained from scratch on a store of two sources: the warm start of the runs below."""
    run = tmp_path_factory.mktemp("start")
    write_store(run, n_train=24, n_heldout=4, sources={"train": ("code", "chat"), "heldout": ("code", "chat")})
    r = launch(run, *COMMON, "train.schedule.max_steps=24", "train.optimizer.lr=1e-2", "train.schedule.warmup_steps=2")
    assert r.returncode == 0, r.stderr[-4000:]
    return run


def warm(start: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(start / "features", run / "features")
    shutil.copy(start / "vocab.safetensors", run / "vocab.safetensors")
    return run


@pytest.mark.slow
def test_a_warm_start_sets_lambda_itself_and_exports_the_guards_choice(start, tmp_path):
    run = warm(start, tmp_path)
    steps = ("train.schedule.max_steps=8", "train.schedule.warmup_steps=2", "train.optimizer.lr=3e-3")
    r = launch(run, *COMMON, *GUARD, *steps, f"drafter.init={start / 'export'}", "train.objective.l2sp=auto")
    assert r.returncode == 0, r.stderr[-4000:]
    rec = json.loads((run / "train" / "l2sp.json").read_text())
    cfg = load_config(TINY, [*COMMON, *steps])
    rate = [cfg.train.optimizer.lr * lr_lambda(cfg.train, 8)(s) for s in range(8)]
    assert rec["window"] == rec["step"] == 2 and rec["probe_micro_batches"] == 2  # one step kept, 2 ranks
    assert rec["lr_sum_window"] == pytest.approx(sum(rate[:2])) and rec["lr_sum_run"] == pytest.approx(sum(rate))
    lam, why = self_set_lambda(rec["loss_gain"], rec["drift"], rec["lr_sum_window"], rec["lr_sum_run"])
    assert rec["lambda"] == lam > 0 and rec["why"] == why and f"λ {lam:.4g} from steps 1-2" in r.stdout
    rows = metrics(run)
    assert [x["l2sp_lambda"] for x in rows] == [0.0] + [lam] * 7  # set at the end of step 2, before its record
    assert [x["step"] for x in rows if "l2sp_self_set" in x] == [2] and rows[1]["l2sp_self_set"] == rec
    state = json.loads((run / "ckpt" / "step-8" / "trainer_state.json").read_text())
    assert state["l2sp"]["lambda"] == lam and state["l2sp"]["auto"] == rec
    guard = json.loads((run / "train" / "guard.json").read_text())
    assert [h["step"] for h in guard["history"]] == [0, 2, 4, 6, 8] and guard["bound"] == 0.01
    assert guard["choice"] == choose(guard["history"], 0.01)
    card = json.loads((run / "export" / "card.json").read_text())
    assert card["which"] == "guarded" and card["step"] == guard["choice"]["step"] and card["guard"] == guard["choice"]
    a, b = load_file(run / "export" / "model.safetensors"), load_file(run / "export-best" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    held = [x for x in rows if "guard_sets" in x]
    assert [x["step"] for x in held] == [2, 4, 6, 8] and all(
        set(x["guard_sets"]) == {"general", "domain"} for x in held
    )

    # an explicit λ wins: no calibration, the same λ from the first step
    explicit = tmp_path / "explicit"
    shutil.copytree(run / "features", explicit / "features")
    shutil.copy(run / "vocab.safetensors", explicit / "vocab.safetensors")
    r = launch(explicit, *COMMON, *steps, f"drafter.init={start / 'export'}", "train.objective.l2sp=0.5")
    assert r.returncode == 0, r.stderr[-4000:]
    assert not (explicit / "train" / "l2sp.json").exists() and "train.l2sp auto" not in r.stdout
    assert {x["l2sp_lambda"] for x in metrics(explicit)} == {0.5}


@pytest.mark.slow
def test_the_guard_keeps_the_start_when_every_step_loses_the_general_tau(start, tmp_path):
    run = warm(start, tmp_path)
    r = launch(
        run,
        *COMMON,
        *GUARD,
        "train.guard.general_bound=0",
        "train.schedule.max_steps=4",
        "train.schedule.warmup_steps=0",
        "train.optimizer.lr=0.5",  # far past what the drafter tolerates: every step forgets
        "train.optimizer.max_grad_norm=0",
        f"drafter.init={start / 'export'}",
    )
    assert r.returncode == 0, r.stderr[-4000:]
    guard = json.loads((run / "train" / "guard.json").read_text())
    start_tau = guard["history"][0]["general"]
    assert start_tau > 1.05 and all(h["general"] < start_tau for h in guard["history"][1:])
    card = json.loads((run / "export" / "card.json").read_text())
    assert card["guard"]["kept_start"] and card["step"] == 0 and "the start is kept" in card["guard"]["why"]
    assert "guard: exported the start (drafter.init)" in r.stdout
    got, init = load_file(run / "export" / "model.safetensors"), load_file(start / "export" / "model.safetensors")
    assert got.keys() == init.keys() and all(torch.equal(got[k], init[k]) for k in init)
