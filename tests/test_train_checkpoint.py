"""Drafter checkpoints: SGLang form round trip, key checks, a K2-layout warm-start checkpoint, refusals."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from train_fixtures import REPO, TINY_TARGET

from eagle3ft.config import load_config
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.export import atomic_dir, drafter_tensors, export_drafter, load_drafter, sglang_target
from eagle3ft.drafter.model import DraftCache, Eagle3Drafter, export_keys
from eagle3ft.train.build import build_drafter
from eagle3ft.train.checkpoint import checkpoints, resume_path


def k2_like_config(**over) -> dict:
    """AQ-MedAI's Kimi-K2 drafter config.json, shrunk to the tiny target (hidden 64, SmolLM2 vocab, 4 layers).

    Same layout: heads == kv heads, heads x head_dim != hidden, DeepSeek-style yarn rope, bf16.
    """
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 64,
        "target_hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 24,
        "intermediate_size": 160,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "vocab_size": 49152,
        "draft_vocab_size": 256,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bias": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True},
        **over,
    }


def write_k2_like(folder: Path, seed: int = 0, **over) -> dict[str, torch.Tensor]:
    """A drafter folder in SGLang's form (config.json + model.safetensors, bf16, its own d2t/t2d)."""
    folder.mkdir(parents=True, exist_ok=True)
    raw = k2_like_config(**over)
    (folder / "config.json").write_text(json.dumps(raw))
    torch.manual_seed(seed)
    m = Eagle3Drafter(DrafterConfig.from_dict(raw))
    chosen = torch.randperm(raw["vocab_size"])[: raw["draft_vocab_size"]].sort().values
    with torch.no_grad():
        m.d2t.copy_(chosen - torch.arange(raw["draft_vocab_size"]))
        m.t2d[chosen] = True
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    tensors = {k: v.bfloat16() if v.is_floating_point() else v for k, v in drafter_tensors(m.state_dict()).items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def test_export_then_load_round_trips_every_key(tmp_path):
    written = write_k2_like(tmp_path / "k2")
    emb = torch.randn(49152, 64)
    m = load_drafter(tmp_path / "k2", emb)
    assert m.fc.weight.dtype == torch.bfloat16 and m.config.rope_scaling["type"] == "yarn"
    assert torch.equal(m.embed_tokens.weight, emb.bfloat16())
    export_drafter(m, tmp_path / "export")
    with safe_open(tmp_path / "export" / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        assert keys == set(export_keys()) and "embed_tokens.weight" not in keys
        for k in keys:
            assert torch.equal(f.get_tensor(k), written[k]), k
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert {k: cfg.get(k) for k in k2_like_config()} == k2_like_config()  # every original field kept, unchanged
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ] == [0, 1, 2]
    # the loaded drafter runs
    out, logits = m.step(
        torch.tensor([[1, 2, 3]]), m.fuse(torch.randn(1, 3, 192).bfloat16()), torch.arange(3)[None], DraftCache()
    )
    assert logits.shape == (1, 3, 256) and torch.isfinite(logits.float()).all()


def test_export_refuses_a_key_set_sglang_would_not_load():
    sd = Eagle3Drafter(DrafterConfig.from_dict(k2_like_config())).state_dict()
    with pytest.raises(ValueError, match=r"skipped silently: \['midlayer.mlp.fc1.weight'\]"):
        drafter_tensors({**sd, "midlayer.mlp.fc1.weight": torch.zeros(1)})
    no_k = {k: v for k, v in sd.items() if k != "midlayer.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"left unfilled: \['model.midlayer.self_attn.qkv_proj.weight\[k\]'\]"):
        drafter_tensors(no_k)
    del sd["d2t"]
    with pytest.raises(ValueError, match=r"missing: \['d2t'\]"):
        drafter_tensors(sd)


def test_every_export_key_lands_in_an_sglang_parameter():
    targets = {k: sglang_target(k) for k in export_keys() if k not in ("d2t", "t2d")}
    assert targets["midlayer.self_attn.v_proj.weight"] == ("model.midlayer.self_attn.qkv_proj.weight", "v")
    assert targets["midlayer.mlp.up_proj.weight"] == ("model.midlayer.mlp.gate_up_proj.weight", "1")
    assert targets["lm_head.weight"] == ("lm_head.weight", "")
    assert sglang_target("embed_tokens.weight") is None and sglang_target("model.layers.0.mlp.down_proj.weight") is None


@pytest.mark.parametrize(
    "over, message",
    [
        (
            {"hidden_size": 96, "target_hidden_size": 96},
            "drafter target_hidden_size 96 != features' target hidden_size 64",
        ),
        ({"vocab_size": 50000}, "drafter vocab_size 50000 != features' target vocab_size 49152"),
        (
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}},
            r"drafter aux layer ids \[1, 2, 3\] != features' aux layer ids \[0, 1, 2\]",
        ),
    ],
)
def test_warm_start_refuses_a_drafter_that_disagrees_with_the_features(tmp_path, over, message):
    (tmp_path / "k2").mkdir()
    (tmp_path / "k2" / "config.json").write_text(json.dumps(k2_like_config(**over)))
    cfg = load_config(REPO / "configs/tiny.yaml", [f"drafter.init={tmp_path / 'k2'}"])
    with pytest.raises(ValueError, match=message):
        build_drafter(cfg.drafter, cfg.target, tmp_path, TINY_TARGET)


def test_atomic_dir_keeps_the_old_folder_on_failure(tmp_path):
    final = tmp_path / "export"
    with atomic_dir(final) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError("killed")
    assert (final / "a").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_resume_picks_the_newest_complete_checkpoint(tmp_path):
    for n in (2, 10, 9):
        (tmp_path / "ckpt" / f"step-{n}").mkdir(parents=True)
        (tmp_path / "ckpt" / f"step-{n}" / "trainer_state.json").write_text("{}")
    (tmp_path / "ckpt" / "step-11").mkdir()  # no trainer_state: incomplete
    (tmp_path / "ckpt" / ".step-12.tmp").mkdir()
    assert [p.name for p in checkpoints(tmp_path)] == ["step-2", "step-9", "step-10"]
    assert resume_path(tmp_path, "auto").name == "step-10"
    assert resume_path(tmp_path, None) is None
    assert resume_path(tmp_path / "nothing", "auto") is None
    with pytest.raises(FileNotFoundError):
        resume_path(tmp_path, str(tmp_path / "ckpt" / "step-11"))


def test_metrics_past_the_resumed_step_are_dropped_in_one_rename(tmp_path):
    from eagle3ft.train.checkpoint import truncate_metrics

    f = tmp_path / "metrics.jsonl"
    f.write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4, 5)) + '{"step": 6, "lo'
    )  # cut short by a kill
    assert truncate_metrics(f, 4) == 2
    assert [json.loads(x)["step"] for x in f.read_text().splitlines()] == [1, 2, 3, 4]
    assert truncate_metrics(f, 4) == 0 and truncate_metrics(tmp_path / "none.jsonl", 4) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_the_data_position_must_split_over_the_new_processes(tmp_path):
    from eagle3ft.train.checkpoint import CheckpointError, resume_position

    st = {"data": {"epoch": 1, "samples_in_epoch": 12, "n_train": 16}}
    assert resume_position(st, tmp_path, 16, 1, 2) == (1, 6)  # 2 processes x micro batch 1: 6 rounds done
    assert resume_position(st, tmp_path, 16, 2, 3) == (1, 2)
    assert resume_position(st, tmp_path, 16, 3, 1) == (1, 4)
    with pytest.raises(CheckpointError, match="12 samples of epoch 1 consumed do not split into rounds of 8"):
        resume_position(st, tmp_path, 16, 4, 2)
    with pytest.raises(CheckpointError, match="written for 16 training samples, the store has 20"):
        resume_position(st, tmp_path, 20, 1, 2)
    assert resume_position({"data": {"epoch": 1, "samples_in_epoch": 16, "n_train": 16}}, tmp_path, 16, 4, 3) == (
        2,
        0,
    )  # epoch done
