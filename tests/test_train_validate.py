"""Held-out τ while training: the TTT unroll's chain counts against eval/offline/accept_len.py's offline chain."""

import pytest
import torch
from _eval_tiny import greedy_items, prompts, tiny_pair

from eagle3ft.data.store import collate
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.eval.offline.accept_len import evaluate
from eagle3ft.train.ttt import TTTObjective
from eagle3ft.train.validate import group_by_source, heldout_batches, heldout_tau, heldout_view, tau_from_counts

DEPTH = 4


@pytest.fixture(scope="module")
def setup():
    target, drafter = tiny_pair()
    items = greedy_items(target, prompts(2, seed=1) + prompts(3, seed=7), 30)  # seen prompts (long runs) and unseen
    return drafter, [{**it, "sample_id": torch.tensor(i)} for i, it in enumerate(items)]


def eagle31(drafter: Eagle3Drafter, fc_norm: bool, norm_output: bool) -> Eagle3Drafter:
    """The fitted drafter's weights in an EAGLE-3.1 layout (fc_norm weights perturbed so they act)."""
    cfg = DrafterConfig(**{**drafter.config.__dict__, "fc_norm": fc_norm, "norm_output": norm_output})
    m = Eagle3Drafter(cfg).double()
    m.load_state_dict(drafter.state_dict(), strict=False)
    if fc_norm:
        with torch.no_grad():
            for n in m.fc_norm:
                n.weight.uniform_(0.8, 1.2, generator=torch.Generator().manual_seed(0))
    return m.eval()


@pytest.mark.parametrize("flags", [(False, False), (True, True)], ids=["eagle3", "eagle3.1"])
@pytest.mark.parametrize("micro_batch", [1, 3])
def test_heldout_tau_equals_offline_chain_tau(setup, flags, micro_batch):
    """On the target's own greedy answers, the TTT unroll's held-out τ (counts summed over the set) equals
    eval/offline/accept_len.py's greedy chain τ at the same depth, count for count; with padding in a batch too."""
    drafter, items = setup
    if flags != (False, False):
        drafter = eagle31(drafter, *flags)
    rep = evaluate(drafter, items, DEPTH)
    objective = TTTObjective(drafter, steps=7, decay=0.8)
    batches = [collate(items[a : a + micro_batch]) for a in range(0, len(items), micro_batch)]
    res = heldout_tau(objective, batches, DEPTH, step=5, device="cpu")
    table = rep.greedy["per_depth"]
    assert res.chain_valid == pytest.approx([r["attempts"] for r in table], abs=1e-9)
    assert res.chain_correct == pytest.approx([r["accepts"] for r in table], abs=1e-9)
    assert res.heldout_tau == pytest.approx(rep.greedy["tau"], abs=1e-12)
    assert rep.greedy["tau"] > 1.3  # the comparison sees accepted chains of several depths
    assert res.heldout_tokens == sum(int(it["loss_mask"].sum()) for it in items) and res.step == 5


def test_ranks_sum_to_one_rank(setup):
    """Items split over ranks (the short rank padded with a zero-mask filler) sum to the single-rank counts."""
    drafter, items = setup
    objective = TTTObjective(drafter, steps=DEPTH, decay=0.8)
    one = heldout_tau(objective, heldout_batches(items, 5, 0, 1, 2, None), DEPTH)
    parts = [heldout_batches(items, 5, r, 2, 2, None) for r in range(2)]
    assert [len(p) for p in parts] == [2, 2]  # 3 items each: rank 1 has two real ones and a filler
    per_rank = [heldout_tau(objective, p, DEPTH) for p in parts]
    summed = heldout_tau(objective, parts[0] + parts[1], DEPTH)
    assert summed.chain_valid == pytest.approx(one.chain_valid) and summed.heldout_tau == pytest.approx(one.heldout_tau)
    assert sum(r.heldout_tokens for r in per_rank) == one.heldout_tokens
    with pytest.raises(ValueError, match="at least 5 steps"):
        heldout_tau(objective, parts[0], 5)


def test_counts_by_hand():
    assert tau_from_counts([8, 3, 0], [10, 6, 3]) == (pytest.approx(1 + 0.8 + 0.8 * 0.5), [0.8, 0.5, 0.0])
    lm = torch.tensor([[0, 0, 1, 1, 1, 0, 1]])
    assert heldout_view({"loss_mask": lm})["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0]]


# --------------------------------------------------------------------------- in the loop (2 CPU processes, DeepSpeed
# ZeRO-2)


@pytest.mark.slow
def test_loop_logs_heldout_tau_and_keeps_the_best_export(tmp_path):
    """eval_every 2 of 5 steps (log_every 4): held-out records at 2, 4 and the end; export-best is the best of
    them and says so; export/ is the last step; a 3.1 drafter trained with the lk_hybrid loss exports its flags."""
    import json

    from safetensors.torch import load_file
    from train_fixtures import REPO, launch, write_store

    from eagle3ft.drafter.export import load_drafter
    from eagle3ft.drafter.model import export_keys

    arch = json.loads((REPO / "configs/drafters/tiny.json").read_text()) | {"fc_norm": True}
    (tmp_path / "tiny31.json").write_text(json.dumps(arch))  # fc_norm from the json, norm_output from the override
    write_store(tmp_path, n_train=12, n_heldout=3)
    r = launch(
        tmp_path,
        "train.schedule.max_steps=5",
        "train.heldout.eval_every=2",
        "train.logging.log_every=4",
        "train.checkpoint.save_every=10",
        "train.schedule.warmup_steps=1",
        "train.objective.loss=lk_hybrid",
        f"drafter.config={tmp_path / 'tiny31.json'}",
        "drafter.norm_output=true",
    )
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [2, 4, 5] and all("loss" in x for x in rows)
    held = [x for x in rows if "heldout_tau" in x]
    assert [x["step"] for x in held] == [2, 4, 5]
    assert (
        held[0]["heldout_tokens"] > 0
        and len(held[0]["heldout_cond_acc"]) == 3
        and all(x["heldout_tau"] >= 1 for x in held)
    )
    best = max(held, key=lambda x: x["heldout_tau"])  # the first of equal ones is kept
    best_card = json.loads((tmp_path / "export-best" / "card.json").read_text())
    last_card = json.loads((tmp_path / "export" / "card.json").read_text())
    assert (
        best_card["which"] == "best"
        and best_card["step"] == best["step"]
        and best_card["heldout_tau"] == best["heldout_tau"]
    )
    assert (
        last_card["which"] == "last" and last_card["step"] == 5 and last_card["heldout_tau"] == held[-1]["heldout_tau"]
    )
    assert [x["heldout_best"] for x in held].count(True) >= 1 and held[-1]["heldout_best_score"] == best["heldout_tau"]
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True
    assert set(load_file(tmp_path / "export-best" / "model.safetensors")) == set(export_keys(fc_norm=True))
    m = load_drafter(tmp_path / "export-best")
    assert m.config.fc_norm and m.config.norm_output


@pytest.mark.slow
def test_cli_on_a_run_folder_counts_what_accept_len_counts(tmp_path):
    """python -m eagle3ft.train.validate on an exported drafter and the run's held-out features: the same
    depth-k chain counts as eval/offline/accept_len.py's run on that folder (greedy synthetic store)."""
    import json

    from train_fixtures import REPO, write_store

    from eagle3ft.config import load_config
    from eagle3ft.drafter.export import export_drafter
    from eagle3ft.drafter.vocab import load_vocab
    from eagle3ft.eval.offline.accept_len import run as accept_len_run
    from eagle3ft.targets.hf import load_input_embedding
    from eagle3ft.train.validate import main

    write_store(tmp_path, n_train=2, n_heldout=4)
    cfg = load_config(REPO / "configs/tiny.yaml")
    m = Eagle3Drafter(DrafterConfig.from_json(REPO / cfg.drafter.config))
    d2t, t2d = load_vocab(tmp_path / "vocab.safetensors")
    with torch.no_grad():
        m.embed_tokens.weight.copy_(load_input_embedding(cfg.target))
        m.d2t.copy_(d2t)
        m.t2d.copy_(t2d)
    export_drafter(m, tmp_path / "export")
    main(["--config", str(REPO / "configs/tiny.yaml"), "--run-dir", str(tmp_path)])
    ours = json.loads((tmp_path / "eval" / "heldout_tau.json").read_text())
    rep = accept_len_run(cfg, tmp_path)
    assert ours["depth"] == 3 and ours["chain_valid"] == pytest.approx([r["attempts"] for r in rep.greedy["per_depth"]])
    assert ours["chain_valid"][0] > 0 and ours["heldout_tau"] == pytest.approx(rep.greedy["tau"], abs=1e-9)


def test_warm_start_keeps_its_layout(tmp_path):
    """drafter.fc_norm / norm_output apply to a scratch drafter; a warm start with another layout is refused."""
    from train_fixtures import REPO, TINY_TARGET, write_store

    from eagle3ft.config import load_config
    from eagle3ft.drafter.export import export_drafter
    from eagle3ft.drafter.vocab import load_vocab
    from eagle3ft.train.build import build_drafter

    write_store(tmp_path)
    m = Eagle3Drafter(DrafterConfig.from_json(REPO / "configs/drafters/tiny.json"))
    d2t, t2d = load_vocab(tmp_path / "vocab.safetensors")
    with torch.no_grad():
        m.d2t.copy_(d2t)
        m.t2d.copy_(t2d)
    export_drafter(m, tmp_path / "init")
    cfg = load_config(REPO / "configs/tiny.yaml", [f"drafter.init={tmp_path / 'init'}", "drafter.norm_output=true"])
    with pytest.raises(ValueError, match="drafter.norm_output True != warm-start drafter's False"):
        build_drafter(cfg.drafter, cfg.target, tmp_path, TINY_TARGET)


def test_heldout_sets_are_the_first_samples_of_each_source():
    names = ["code", "chat", "code", None, "chat", "code", "chat"]
    assert group_by_source(names, 2) == {"code": [0, 2], "chat": [1, 4], "heldout": [3]}
    assert group_by_source([None, None], 5) == {"heldout": [0, 1]}


@pytest.mark.slow
def test_loop_gives_tau_per_heldout_set_and_keeps_the_best_by_the_named_mix(tmp_path):
    """Two held-out sets (the sources the store recorded) and a replay mix: τ per set and over both (counts summed)
    at every evaluation; export-best is the step of the best τ of the set train.best_on names; the data summary
    gives the mix."""
    import json

    from train_fixtures import REPO, launch, write_store

    from eagle3ft.config import load_config
    from eagle3ft.train.data import TrainData

    SOURCES = "[{kind: humaneval, name: code}, {kind: sharegpt, name: chat, weight: 0.5}]"
    write_store(tmp_path, n_train=12, n_heldout=6, sources={"train": ("code", "chat"), "heldout": ("code", "chat")})
    r = launch(
        tmp_path,
        f"harvest.sources={SOURCES}",
        "train.schedule.max_steps=6",
        "train.heldout.eval_every=2",
        "train.checkpoint.save_every=10",
        "train.schedule.warmup_steps=1",
        "train.heldout.eval_samples=2",
        "train.heldout.best_on={chat: 1}",
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "chosen on {'chat': 1.0}" in r.stdout
    rows = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    held = [x for x in rows if "heldout_sets" in x]
    assert [x["step"] for x in held] == [2, 4, 6]
    for x in held:
        sets = x["heldout_sets"]
        assert list(sets) == ["code", "chat"] and x["heldout_score"] == sets["chat"]["tau"]
        assert x["heldout_tokens"] == sets["code"]["tokens"] + sets["chat"]["tokens"]
        assert min(s["tau"] for s in sets.values()) <= x["heldout_tau"] <= max(s["tau"] for s in sets.values())
    best = max(held, key=lambda x: x["heldout_sets"]["chat"]["tau"])
    card = json.loads((tmp_path / "export-best" / "card.json").read_text())
    assert card["step"] == best["step"] and card["heldout_score"] == best["heldout_sets"]["chat"]["tau"]
    assert card["best_on"] == {"chat": 1.0} and card["heldout_sets"] == best["heldout_sets"]
    data = json.loads((tmp_path / "train" / "data.json").read_text())
    assert {n: (m["samples"], m["weight"]) for n, m in data["sources"].items()} == {"code": (6, 1.0), "chat": (6, 0.5)}
    cfg = load_config(REPO / "configs/tiny.yaml", [f"harvest.sources={SOURCES}"])
    order = TrainData(cfg, tmp_path).order(0)  # every code sample once, each chat sample with probability 1/2
    drawn = [s for x in rows if x["epoch"] == 0 for rank in x["samples"] for s in rank]
    assert drawn[: len(order)] == order  # rank 0 and rank 1 take the weighted order's draws in turn
    code = [i for i in order if i % 2 == 0]  # the store records sample i under code, chat, code, ...
    assert sorted(code) == list(range(0, 12, 2)) and len(order) - len(code) < 6
