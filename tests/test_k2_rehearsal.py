"""configs/kimi-k2-rehearsal.yaml: a K2-shaped 4-layer target that SGLang serves with dummy weights and no tokenizer.
On the CPU: the config, its drafter against its target, the server command, and its harvest (token ids only, one
answer per conversation) against the double of a --skip-tokenizer-init EAGLE3 server on the tiny DeepSeek-V3."""

import json
import sys
from pathlib import Path

import pytest
import requests
import torch

from eagle3ft.config import REPO_ROOT, load_config, resolve_path
from eagle3ft.data.harvest import run_harvest
from eagle3ft.data.store import FeatureStore
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.targets.hf import load_target, load_tokenizer
from eagle3ft.targets.sglang import target_identity
from eagle3ft.targets.sglang_server import build_command, drafter_aux_ids

sys.path.insert(0, str(Path(__file__).parent))
from sglang_double import NO_TOKENIZER, DoubleEngine, SGLangDouble  # noqa: E402
from test_sglang_harvest import tiny_drafter  # noqa: E402

REHEARSAL = REPO_ROOT / "configs" / "kimi-k2-rehearsal.yaml"


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_config_loads_and_its_drafter_fits_its_k2_shaped_target():
    cfg = load_config(REHEARSAL)
    raw = json.loads((resolve_path(cfg.target.path) / "config.json").read_text())
    assert raw["architectures"] == ["DeepseekV3ForCausalLM"] and raw["num_hidden_layers"] == 4
    k2 = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64}
    k2 |= {"v_head_dim": 128, "num_attention_heads": 64, "n_shared_experts": 1, "first_k_dense_replace": 1}
    k2 |= {"n_routed_experts": 16, "num_experts_per_tok": 8}
    assert {k: raw[k] for k in k2} == k2
    spec = DrafterConfig.from_json(resolve_path(cfg.drafter.config)).check_supported()
    assert (spec.hidden_size, spec.vocab_size, spec.draft_vocab_size, spec.head_dim) == (7168, 163840, 32000, 128)
    identity = target_identity(cfg.target, cfg.harvest.sglang)
    assert identity == (7168, 163840, 4)
    assert spec.check_target(*identity) == [0, 1, 2]
    assert spec.to_hf_dict()["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's form of the same layers
    assert len(load_tokenizer(cfg.target)) <= 163840  # the stand-in's ids are all the target's

    cmd = build_command(cfg, "harvest").argv
    draft = resolve_path(cfg.serve.harvest_draft)
    assert flag(cmd, "--model-path") == str(resolve_path(cfg.target.path))
    assert flag(cmd, "--speculative-draft-model-path") == str(draft) and drafter_aux_ids(draft) == [0, 1, 2]
    assert flag(cmd, "--load-format") == "dummy" and flag(cmd, "--speculative-draft-load-format") == "dummy"
    assert "--skip-tokenizer-init" in cmd and "--enable-return-hidden-states" in cmd
    assert flag(cmd, "--speculative-algorithm") == "EAGLE3" and flag(cmd, "--tp-size") == "1"


@pytest.fixture(scope="module")
def no_tokenizer_server():
    """An EAGLE3 harvest server started with --skip-tokenizer-init, on the tiny DeepSeek-V3."""
    cfg = load_config(REPO_ROOT / "configs" / "tiny-deepseek.yaml")
    model, tok = load_target(cfg.target)
    d = SGLangDouble(DoubleEngine(model, tok, drafter=tiny_drafter(model)), server_args={"skip_tokenizer_init": True})
    yield d.start(), model
    d.stop()


def test_its_harvest_sends_token_ids_only_to_a_server_without_a_tokenizer(no_tokenizer_server, tmp_path):
    double, model = no_tokenizer_server
    refused = requests.post(double.url + "/generate", json={"text": "hi", "sampling_params": {}}, timeout=30)
    assert refused.status_code == 400 and NO_TOKENIZER in refused.text
    small = {  # the rehearsal's harvest, on the tiny DeepSeek-V3 and its drafter instead of the K2 shapes
        "target.kind": "tiny",
        "target.path": "",
        "target.tiny.config": "configs/targets/tiny-deepseek-v3/config.json",
        "drafter.config": "configs/drafters/tiny.json",
        "harvest.sources": "[{kind: sharegpt, limit: 4}, {kind: mtbench, limit: 2, split: heldout}]",
        "harvest.max_new_tokens": "12",
        "harvest.shard_samples": "2",
        "harvest.batch_size": "2",
        "harvest.sglang.urls": f"[{double.url}]",
    }
    cfg = load_config(REHEARSAL, [f"{k}={v}" for k, v in small.items()])
    summary = run_harvest(cfg, tmp_path)
    assert summary["samples"] == {"train": 4, "heldout": 2} and summary["argmax_check"]["mismatched"] == 0
    assert summary["target"]["aux_layer_ids"] == [0, 1, 2] and summary["target"]["name"] == "kimi-k2-rehearsal"
    H = model.config.hidden_size
    for split in ("train", "heldout"):
        for item in FeatureStore(tmp_path / "features").dataset(split):
            mask = item["loss_mask"].tolist()
            assert mask.index(1) == len(mask) - sum(mask)  # one answer, at the end
            with torch.no_grad():
                hs = model(input_ids=item["input_ids"][None], output_hidden_states=True).hidden_states
            for k, i in enumerate([0, 1, 2]):  # SGLang's DeepSeek rule: the states entering layers 0, 1, 2
                torch.testing.assert_close(
                    item["aux_hidden"][:, k * H : (k + 1) * H].float(),
                    hs[i][0].to(torch.bfloat16).float(),
                    atol=0.02,
                    rtol=0.02,
                )


def test_the_layer_check_finds_the_servers_layers_and_a_shift(no_tokenizer_server, tmp_path):
    """benchmarks/aux_layers_match.py, the GPU rehearsal's check of SGLang's capture against the embedded one."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("aux_layers_match", REPO_ROOT / "benchmarks/aux_layers_match.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    double, _ = no_tokenizer_server
    fixed = [  # the rehearsal's harvest of the dataset's conversations as they are, on the tiny DeepSeek-V3
        "target.kind=tiny",
        "target.path=",
        "target.tiny.config=configs/targets/tiny-deepseek-v3/config.json",
        "drafter.config=configs/drafters/tiny.json",
        "harvest.sources=[{kind: sharegpt, limit: 3}]",
        "harvest.regenerate=false",
        f"harvest.sglang.urls=[{double.url}]",
    ]
    run_harvest(load_config(REHEARSAL, fixed), tmp_path / "sglang")
    run_harvest(load_config(REHEARSAL, fixed + ["harvest.backend=hf"]), tmp_path / "hf")
    ok = check.verdict(tmp_path / "sglang" / "features", tmp_path / "hf" / "features")
    assert ok["same_layers"] and max(ok["relative_l1"][i][i] for i in range(3)) < 0.01
    shifted = tmp_path / "shifted.json"  # layers 2, 0, 1 where the server holds 0, 1, 2
    raw = json.loads((REPO_ROOT / "configs/drafters/tiny.json").read_text())
    shifted.write_text(json.dumps({**raw, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 0, 1]}}))
    run_harvest(load_config(REHEARSAL, fixed + ["harvest.backend=hf", f"drafter.config={shifted}"]), tmp_path / "off")
    off = check.verdict(tmp_path / "sglang" / "features", tmp_path / "off" / "features")
    assert not off["same_layers"] and off["nearest"] == [1, 2, 0]
    spec = importlib.util.spec_from_file_location("sglang_target", REPO_ROOT / "benchmarks/sglang_target.py")
    stores = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stores)
    same = stores.compare_stores(tmp_path / "sglang", tmp_path / "hf")["splits"]["train"]
    assert len(same["aux_cosine_min_by_chunk"]) == 3 and min(same["aux_cosine_mean_by_chunk"]) > 0.999
    moved = stores.compare_stores(tmp_path / "sglang", tmp_path / "off")["splits"]["train"]
    assert max(moved["aux_cosine_mean_by_chunk"]) < 0.99


def test_seeded_weights_are_one_folder_per_seed_that_the_embedded_target_loads(tmp_path):
    """benchmarks/sglang_target.py seeded: the rehearsal's weights, made on the device and never carried. The same seed
    gives the same bytes; the experts are saved one tensor each, the names SGLang's DeepSeek loader reads."""
    import importlib.util

    from safetensors import safe_open

    spec = importlib.util.spec_from_file_location("sglang_target", REPO_ROOT / "benchmarks/sglang_target.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    config_json = str(REPO_ROOT / "configs/targets/tiny-deepseek-v3/config.json")
    a, b, c = (tool.seeded(config_json, seed, str(tmp_path / f"w{k}")) for k, seed in enumerate((0, 0, 1)))
    files = [Path(x["out"]) / "model.safetensors" for x in (a, b, c)]
    assert files[0].read_bytes() == files[1].read_bytes() != files[2].read_bytes()
    with safe_open(files[0], "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in keys and "model.layers.1.mlp.gate.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    assert json.loads((Path(a["out"]) / "config.json").read_text())["torch_dtype"] == "bfloat16"
    cfg = load_config(REPO_ROOT / "configs/tiny-deepseek.yaml", ["target.kind=hf", f"target.path={a['out']}"])
    model, _ = load_target(cfg.target)
    with safe_open(files[0], "pt") as f:
        assert torch.equal(
            model.model.layers[1].mlp.gate.weight, f.get_tensor("model.layers.1.mlp.gate.weight").to(model.dtype)
        )


def test_a_learnable_target_answers_in_its_kept_ids_with_a_peaked_distribution(tmp_path):
    """sglang_target.py seeded --emit: the rehearsal's target, shaped so that a drafter can learn it (a drawn one is
    flat: every drafter stayed at τ 1.00 on it)."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location("sglang_target", REPO_ROOT / "benchmarks/sglang_target.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    config_json = str(REPO_ROOT / "configs/targets/tiny-deepseek-v3/config.json")
    probs = {}
    for name, emit in (("drawn", None), ("shaped", 64)):
        made = tool.seeded(config_json, 0, str(tmp_path / name), emit=emit, branch=0.3, gain=6.0)
        model = AutoModelForCausalLM.from_pretrained(made["out"], dtype=torch.float32)
        kept = set(model.lm_head.weight.abs().sum(-1).nonzero().flatten().tolist())
        out = model.generate(torch.tensor([[3, 17, 400, 9000, 25]]), max_new_tokens=24, do_sample=False)[0, 5:]
        with torch.no_grad():
            probs[name] = model(out[None]).logits.softmax(-1).amax(-1).median().item()
        if emit:
            assert len(kept) == emit and set(out.tolist()) <= kept
            assert made["learnable"] == {"emit": 64, "branch": 0.3, "gain": 6.0}
    assert probs["drawn"] < 0.01 < 0.3 < probs["shaped"]  # a flat next-token distribution against a peaked one


def test_the_bigram_count_and_the_width_scaled_branch():
    """sglang_target.py bigram: leave one answer out, the other answers' most frequent successor of each token; the
    branch scale that keeps a shaped target as predictable as at width 512 (records 35h)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sglang_target", REPO_ROOT / "benchmarks/sglang_target.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    # 1 -> 2 right twice and 2 -> 1 once in the first answer, two of three in the second, 5 never seen elsewhere
    got = tool.bigram_top1([[1, 2, 1, 2], [1, 2, 1, 3], [5, 6]])
    low, high = got.pop("bigram_top1_interval")  # three answers, hits 3/3, 2/3 and 0/1, resampled whole
    assert 0 < low < 5 / 7 < high < 1
    assert got == {"pairs": 7, "current_seen": round(6 / 7, 3), "bigram_top1": round(5 / 7, 3)}
    low, high = tool.bigram_top1([[1, 2, 1, 2, 1, 2]] * 6)["bigram_top1_interval"]
    assert low == high == 1.0  # every answer alike: no spread
    assert [tool.width_branch(w) for w in (64, 512, 2048)] == [0.3, 0.3, 0.075]
    assert tool.width_branch(7168) == pytest.approx(0.0214, abs=1e-4)
    config_json = str(REPO_ROOT / "configs/targets/tiny-deepseek-v3/config.json")
    res = tool.bigram(config_json, 0, emit=64, gain=6.0, branches=[0.3, 0.01], answers=3, new=8, device="cpu")
    assert [r["branch"] for r in res["runs"]] == [0.3, 0.01] and all(r["pairs"] == 21 for r in res["runs"])
