"""An export's config.json as vLLM reads it: the top-level aux ids, in vLLM's convention, name SGLang's layers."""

import json
from pathlib import Path

import pytest
import torch

from eagle3ft.config import load_config
from eagle3ft.drafter.config import DrafterConfig, capture_points
from eagle3ft.drafter.export import export_drafter
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.targets.base import Request, Sampling
from eagle3ft.targets.hf import HFTarget, load_target, target_architectures

REPO = Path(__file__).resolve().parent.parent
TARGETS = {"llama": REPO / "configs" / "tiny.yaml", "deepseek-v3": REPO / "configs" / "tiny-deepseek.yaml"}


def vllm_layer_ids(config_json: Path) -> tuple[int, ...] | None:
    """vllm 0.19.1, v1/worker/gpu_model_runner.py lines 4889-4911 (_get_eagle3_aux_layers_from_config): the ids come
    from the draft's hf_config attribute `eagle_aux_hidden_state_layer_ids` (config.json's top level) alone; None
    means the model's default (lines 4795-4806)."""
    ids = json.loads(config_json.read_text()).get("eagle_aux_hidden_state_layer_ids")
    return tuple(ids) if ids and isinstance(ids, (list, tuple)) else None


def vllm_capture(model, input_ids: torch.Tensor, layer_ids: tuple[int, ...]) -> list[torch.Tensor]:
    """vllm 0.19.1's capture, models/deepseek_v2.py lines 1235-1242 (DeepseekV2Model.forward: `if idx in
    aux_hidden_state_layers: append(hidden_states + residual)` before layer idx runs) and models/llama.py lines
    419-428 (LlamaModel.forward: id 0 before the first layer, id idx + 1 after layer idx): id j is the residual stream
    entering decoder layer j. vLLM keeps the residual apart (fused add-norm), so hidden_states + residual is what a
    transformers decoder layer takes as its input; a pre-hook on layer j sees it."""
    got: dict[int, torch.Tensor] = {}

    def entering(j):
        def hook(module, args, kwargs):
            got[j] = (args[0] if args else kwargs["hidden_states"])[0]

        return hook

    hooks = [model.model.layers[j].register_forward_pre_hook(entering(j), with_kwargs=True) for j in layer_ids]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for h in hooks:
            h.remove()
    return [got[j] for j in layer_ids]


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request):
    cfg = load_config(TARGETS[request.param])
    model, tokenizer = load_target(cfg.target)
    return cfg, model, tokenizer


def test_an_export_names_for_vllm_the_layers_sglang_captures(target, tmp_path):
    cfg, model, tokenizer = target
    spec = DrafterConfig.from_json(REPO / cfg.drafter.config)
    spec.aux_layer_ids = [0, 1, 2]
    spec.vllm_aux_layer_ids = capture_points(target_architectures(cfg.target), spec.aux_layer_ids)  # as train sets
    export_drafter(Eagle3Drafter(spec), tmp_path / "export")
    vllm_ids = vllm_layer_ids(tmp_path / "export" / "config.json")
    # a Llama: the outputs of layers 0-2; a DeepSeek-V3, ids not starting at 1: the states entering layers 0-2
    assert vllm_ids == ((0, 1, 2) if "deepseek" in str(cfg.target.tiny.config) else (1, 2, 3))

    ids = [3, 17, 400, 9000, 25, 77, 1024]
    sglang = HFTarget(cfg.target, spec.aux_layer_ids, model=model, tokenizer=tokenizer)  # output of layer i: hooks
    (res,) = sglang.process([Request(ids, 0, (2,), capture=True)], Sampling(topk=4))
    H = model.config.hidden_size
    picked = vllm_capture(model, torch.tensor([ids]), vllm_ids)
    for k, (i, row) in enumerate(zip(spec.aux_layer_ids, picked)):
        assert torch.equal(res.features.aux_hidden[:, k * H : (k + 1) * H], row.to(torch.bfloat16)), f"SGLang id {i}"
    # the nested ids read as vLLM's name other layers
    assert not torch.equal(vllm_capture(model, torch.tensor([ids]), (2,))[0], picked[0])


def test_sglangs_capture_rule_per_target_in_vllms_ids():
    """SGLang 0.5.17 adds 1 to a DeepSeek-V3 target's ids only when the first is 1 (models/deepseek_v2.py), and always
    on a Llama: AQ-MedAI's [2, 30, 58] and the default [1, 29, 57] both name the states entering layers 2, 30, 58."""
    for arch in (["DeepseekV3ForCausalLM"], ["KimiK25ForConditionalGeneration"]):
        assert capture_points(arch, [2, 30, 58]) == [2, 30, 58]
        assert capture_points(arch, [1, 29, 57]) == [2, 30, 58]
    assert capture_points(["LlamaForCausalLM"], [2, 30, 58]) == [3, 31, 59]
    assert capture_points(None, [1, 14, 26]) == [2, 15, 27]


def test_the_ids_read_back_from_either_form_and_none_leaves_both_defaults():
    spec = DrafterConfig.from_json(REPO / "configs" / "drafters" / "kimi-k2.json")
    d = spec.to_hf_dict()
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert d["eagle_aux_hidden_state_layer_ids"] == [3, 31, 59]
    assert DrafterConfig.from_dict(d).aux_layer_ids == [2, 30, 58]
    vllm_only = {k: v for k, v in d.items() if k != "eagle_config"}
    assert DrafterConfig.from_dict(vllm_only).aux_layer_ids == [2, 30, 58]
    spec.aux_layer_ids = None  # SGLang's [1, L//2-1, L-4] and vLLM's (2, L//2, L-3) are the same layers
    assert "eagle_aux_hidden_state_layer_ids" not in spec.to_hf_dict()


def test_the_shipped_drafter_carries_the_vllm_ids():
    raw = json.loads((REPO / "drafters" / "smollm2-135m" / "config.json").read_text())
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert raw["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert DrafterConfig.from_dict(raw).to_hf_dict() == raw
