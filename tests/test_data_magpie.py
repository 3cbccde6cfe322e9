"""data/magpie.py on the tiny random Llama: N filtered prompts, a resume after a kill without duplicates, the
prompts regenerated into a token store that names each sample's source, and online training leaving one out;
data/contamination.py drops a planted held-out prompt."""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest

from eagle3ft.config import REPO_ROOT, SourceConfig, load_config
from eagle3ft.data import magpie
from eagle3ft.data.chat import ChatFormat
from eagle3ft.data.contamination import HeldoutGrams, main
from eagle3ft.data.prompts import mtbench_path
from eagle3ft.data.regen import run_regen
from eagle3ft.data.tokens import TokenStore
from eagle3ft.targets import hf
from eagle3ft.train.data import TrainData

sys.path.insert(0, str(REPO_ROOT / "tests"))
from sglang_double import DoubleEngine, SGLangDouble  # noqa: E402

TINY = REPO_ROOT / "configs" / "tiny.yaml"
SETS = ["harvest.magpie.count=6", "harvest.magpie.chunk=4", "harvest.magpie.max_tokens=24", "harvest.batch_size=4"]


@pytest.fixture(scope="module")
def ending_model():
    """The tiny random Llama with <|im_end|>'s logit raised by 5: sampled user turns end."""
    cfg = load_config(TINY)
    model, tok = hf.load_target(cfg.target)
    eot = ChatFormat(tok, cfg.target.chat_template).stop_ids[0]

    def bias(module, args, out):
        out[..., eot] += 5.0
        return out

    model.lm_head.register_forward_hook(bias)
    return model, tok


def lines(run):
    return [json.loads(x) for x in (run / "magpie" / "prompts.jsonl").read_text().splitlines()]


def test_header_is_chatml_up_to_user(ending_model):
    tok = ending_model[1]
    head = tok.decode(magpie.user_header_ids(ChatFormat(tok, "auto")))
    assert head.startswith("<|im_start|>system\n") and head.endswith("<|im_end|>\n<|im_start|>user\n")


def test_magpie_prompts_resume_and_regen(ending_model, monkeypatch, tmp_path):
    monkeypatch.setattr(hf, "load_target", lambda cfg: ending_model)
    cfg = load_config(TINY, SETS)
    straight = magpie.run_magpie(cfg, tmp_path / "a")
    kept = lines(tmp_path / "a")
    texts = [r["messages"][0]["content"] for r in kept]
    assert straight["kept"] == len(kept) == 6 and len(set(texts)) == 6
    assert all(t.strip() for t in texts)
    assert straight["draws"] == 6 + sum(straight["filtered"].values())

    from eagle3ft.data import regen_backends

    real, calls = regen_backends.HFBackend.generate, []

    def dies_second_call(self, slot, batch):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run is killed inside its second chunk
        return real(self, slot, batch)

    monkeypatch.setattr(regen_backends.HFBackend, "generate", dies_second_call)
    with pytest.raises(KeyboardInterrupt):
        magpie.run_magpie(cfg, tmp_path / "b")
    with open(tmp_path / "b" / "magpie" / "prompts.jsonl", "a") as f:
        f.write('{"id": "half a li')  # a kill in the middle of an append
    monkeypatch.setattr(regen_backends.HFBackend, "generate", real)
    resumed = magpie.run_magpie(cfg, tmp_path / "b")
    assert lines(tmp_path / "b") == kept and resumed["filtered"] == straight["filtered"]

    path = tmp_path / "a" / "magpie" / "prompts.jsonl"
    sources = f"harvest.sources=[{{kind: sharegpt, limit: 3}}, {{kind: file, path: {path}, name: magpie}}]"
    rcfg = load_config(TINY, [sources])
    summary = run_regen(rcfg, tmp_path / "a")
    assert summary["counts"]["train"]["samples"] == 9
    store = TokenStore(tmp_path / "a" / "tokens")
    assert Counter(store.sources("train")) == {"sharegpt": 3, "magpie": 6}
    assert store.manifest["source_counts"]["train"]["magpie"]["samples"] == 6

    ids = {x["sample_id"]: x["input_ids"].tolist() for x in store.dataset("train")}
    names = dict(zip([x["sample_id"] for x in store.dataset("train")], store.sources("train")))
    kept = TrainData(
        load_config(TINY, [sources, "train.data.features=online", "train.data.drop_sources=[magpie]"]), tmp_path / "a"
    )
    assert len(kept.dataset) == 3
    assert all(
        names[x["sample_id"]] == "sharegpt" and x["input_ids"].tolist() == ids[x["sample_id"]] for x in kept.dataset
    )


@pytest.mark.slow
def test_magpie_through_sglang_servers(ending_model, tmp_path):
    """Two SGLang servers (the protocol double over the same model), batched /generate calls with input_ids."""
    model, tok = ending_model
    ds = [SGLangDouble(DoubleEngine(model, tok), version="0.5.17").start() for _ in range(2)]
    try:
        urls = ", ".join(d.url for d in ds)
        sets = ["harvest.backend=sglang", f"harvest.sglang.urls=[{urls}]", "harvest.sglang.prompts_per_request=2"]
        summary = magpie.run_magpie(load_config(TINY, SETS + sets), tmp_path)
    finally:
        for d in ds:
            d.stop()
    texts = [r["messages"][0]["content"] for r in lines(tmp_path)]
    assert summary["kept"] == len(texts) == 6 and len(set(texts)) == 6
    assert summary["generation"]["backend"] == "sglang"


def test_contamination_drops_planted_heldout(ending_model, tmp_path, capsys):
    question = json.loads(mtbench_path().read_text().splitlines()[3])["turns"][0]
    grams = HeldoutGrams([SourceConfig(kind="mtbench"), SourceConfig(kind="file", path="data/sets/everyday-v1.jsonl")])
    assert grams.hits("Please answer this: " + question) == {"mtbench"}
    assert not grams.hits("How do I boil an egg so that the yolk stays soft?")
    cfg = load_config(TINY)
    flt = magpie.PromptFilter(cfg.harvest.magpie, grams, ["<|im_start|>"])
    assert flt.reason(question.upper(), True) == "heldout_8gram"
    flt.keep("How do I boil an egg?")
    assert flt.reason("how do i boil an egg", True) == "near_duplicate"
    train = tmp_path / "train.jsonl"
    train.write_text(
        json.dumps({"messages": [{"role": "user", "content": "a fine question about rivers and lakes"}]})
        + "\n"
        + json.dumps({"turns": [question]})
        + "\n"
    )
    with pytest.raises(SystemExit) as e:
        main([str(train), "--heldout", "mtbench"])
    assert e.value.code == 1
    assert json.loads(capsys.readouterr().out)["contaminated_user_turns"] == {str(train): {"mtbench": 1}}


def test_sampled_answers_beside_greedy(ending_model, monkeypatch, tmp_path):
    """harvest.temperature > 0: answers are drawn with a seed per conversation and turn (a rerun draws the same),
    differ from the T=0 pass, and the sampled store trains beside the greedy one (train.more_tokens). One sample per
    prompt: there is no setting for several."""
    monkeypatch.setattr(hf, "load_target", lambda cfg: ending_model)
    base = ["harvest.sources=[{kind: sharegpt, limit: 8}]", "harvest.max_turns=1"]

    def answers(run, *sets):
        run_regen(load_config(TINY, base + list(sets)), tmp_path / run)
        return {x["sample_id"]: x["input_ids"].tolist() for x in TokenStore(tmp_path / run / "tokens").dataset("train")}

    greedy, sampled = answers("t0"), answers("t1", "harvest.temperature=1.0")
    assert sampled == answers("t1b", "harvest.temperature=1.0")
    assert sampled.keys() == greedy.keys() and sampled != greedy
    more = f"train.data.more_tokens=[{tmp_path / 't1' / 'tokens'}]"
    both = TrainData(load_config(TINY, base + ["train.data.features=online", more]), tmp_path / "t0")
    assert len(both.dataset) == 16
