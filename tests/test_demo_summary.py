"""The demo's before/after on the tiny target: disjoint HumanEval splits, offline tau per held-out set, one
interleaved bench of plain decoding and two drafters on two prompt sets, and the headline that joins them."""

import json

import pytest
import torch

from eagle3ft.config import REPO_ROOT, load_config
from eagle3ft.data.harvest import run_harvest
from eagle3ft.data.sources import group_by_source, sample_sources
from eagle3ft.data.store import FeatureStore
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.export import export_drafter, load_drafter
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.eval.bench import measure
from eagle3ft.eval.offline.accept_len import evaluate
from eagle3ft.eval.report import demo_summary

TINY = REPO_ROOT / "configs" / "tiny.yaml"


def random_drafter(folder, seed: int, eagle31: bool = False) -> None:
    torch.manual_seed(seed)
    arch = json.loads((REPO_ROOT / "configs/drafters/tiny.json").read_text())
    if eagle31:  # the shipped drafter may carry EAGLE-3.1's flags: nothing in the demo may assume either layout
        arch |= {"fc_norm": True, "norm_output": True}
    (folder.parent / "arch.json").write_text(json.dumps(arch))
    d = Eagle3Drafter(DrafterConfig.from_json(folder.parent / "arch.json"))
    d.t2d[: d.config.draft_vocab_size] = True  # d2t 0: draft id i is target id i
    export_drafter(d, folder)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    run = root / "run"
    random_drafter(root / "shipped", seed=1, eagle31=True)
    cfg = load_config(
        TINY,
        [
            "harvest.sources=[{kind: humaneval, limit: 2, split: heldout}, {kind: humaneval, limit: 3, split: train},"
            " {kind: mtbench, limit: 2, split: heldout}]",
            "harvest.max_turns=1",
            "harvest.max_new_tokens=6",
            "harvest.max_prompt_tokens=384",
            "bench.prompts={kind: humaneval, limit: 1}",
            "bench.more_prompts=[{kind: mtbench, limit: 1}]",
            f"bench.drafters={{shipped: '{root / 'shipped'}'}}",
            "bench.max_new_tokens=6",
            "bench.repetitions=2",
        ],
    )
    run_harvest(cfg, run)
    random_drafter(run / "export", seed=2)
    return cfg, run


def test_humaneval_train_and_heldout_problems_are_disjoint(demo_run):
    cfg, run = demo_run
    store = FeatureStore(run / "features")
    train, held = store.dataset("train"), store.dataset("heldout")
    train_ids = {int(train[i]["sample_id"]) for i in range(len(train))}
    held_ids = {int(held[i]["sample_id"]) for i in range(len(held))}
    assert len(train_ids) == 3 and len(held_ids) == 4 and not train_ids & held_ids
    groups = group_by_source(store.sources("heldout"))
    assert {k: len(v) for k, v in groups.items()} == {"humaneval": 2, "mtbench": 2}
    assert sample_sources(store, cfg.harvest, "train") == ["humaneval"] * 3


def test_a_store_without_recorded_sources_finds_them_from_the_sample_ids(demo_run, tmp_path):
    import shutil

    cfg, run = demo_run
    old = shutil.copytree(run / "features", tmp_path / "features")
    manifest = json.loads((old / "manifest.json").read_text())
    for shard in manifest["shards"]:
        del shard["sources"]  # as a harvest wrote it before the names were recorded
    (old / "manifest.json").write_text(json.dumps(manifest))
    store = FeatureStore(old, verify=False)
    assert store.sources("heldout") == [None] * 4
    assert sample_sources(store, cfg.harvest, "heldout") == FeatureStore(run / "features").sources("heldout")


def test_offline_per_set_adds_up_to_the_whole_heldout_split(demo_run):
    cfg, run = demo_run
    res = measure.run_offline(cfg, run, only=["shipped"], log=lambda *a: None)
    assert list(res) == ["shipped"] and (run / "demo" / "offline-shipped.json").is_file()
    sets = res["shipped"]["sets"]
    held = FeatureStore(run / "features").dataset("heldout")
    drafter = load_drafter(res["shipped"]["checkpoint"]).float().eval()
    with torch.no_grad():
        whole = evaluate(drafter, (held[i] for i in range(len(held))), cfg.eval.steps, 1, cfg.eval.steps + 1)
    assert sum(s["roots"] for s in sets.values()) == whole.roots
    assert sum(s["conversations"] for s in sets.values()) == whole.samples == 4
    for s in sets.values():
        assert 1.0 <= s["settings"]["3/1/4"] <= 4.0 and s["answer_tokens"] > 0
    with pytest.raises(ValueError, match="not a drafter of this config"):
        measure.run_offline(cfg, run, only=["nope"])


def test_measure_then_headline(demo_run):
    cfg, run = demo_run
    summary = measure.run_measure(cfg, run, log=lambda *a: None)
    assert list(summary["prompt_sets"]) == ["humaneval", "mtbench"]
    for pset in summary["prompt_sets"].values():
        assert list(pset["drafters"]) == ["export", "shipped"]
        for d in pset["drafters"].values():
            assert d["speculative"][0]["outputs_match_baseline"] == 1.0  # greedy speculation equals plain, per drafter
    h = demo_summary.run_headline(cfg, run)
    assert (h["before"], h["after"], h["domain"]) == ("shipped", "export", "humaneval")
    assert [s["kind"] for s in h["sets"]] == ["humaneval", "mtbench"]  # the domain first, once
    for s in h["sets"]:
        off = json.loads((run / "demo" / "offline-shipped.json").read_text())["sets"][s["kind"]]
        assert s["offline"]["before"] == off["settings"]["3/1/4"]
        live = summary["prompt_sets"][s["kind"]]
        row = live["drafters"]["export"]["speculative"][0]
        assert s["live"]["after"]["tau"] == row["tau"] and s["live"]["plain_tok_s"] == live["baseline"]["tok_s_median"]
        be = s["live"]["after"]["break_even_tau"]
        assert be == pytest.approx(row["cycle_s_per_pass"] / (live["baseline"]["ms_per_token"] / 1e3))
    text = h["headline"]
    assert text.index("domain (humaneval)") < text.index("general (mtbench)") and text.count("domain (humaneval)") == 1
    assert "tau offline" in text and "tau live" in text and "break-even" in text and "against plain" in text
    assert (run / "demo" / "summary.md").read_text().count("tau live") == 2


def test_headline_cli_without_a_bench_prints_offline_only(demo_run, tmp_path, capsys):
    cfg, run = demo_run
    bare = tmp_path / "bare"
    (bare / "demo").mkdir(parents=True)
    for label in ("shipped", "export"):
        (bare / "demo" / f"offline-{label}.json").write_text((run / "demo" / "offline-shipped.json").read_text())
    shipped = cfg.bench.drafters["shipped"]
    demo_summary.main(
        ["headline", "--config", str(TINY), "--run-dir", str(bare), "--set", f"bench.drafters={{shipped: '{shipped}'}}"]
    )
    out = capsys.readouterr().out
    assert "tau offline" in out and "tau live" not in out
