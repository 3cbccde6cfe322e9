"""The shipped SmolLM2 drafter (drafters/smollm2-135m): SGLang's folder form, its card, its vocabulary, and that
the embedded default config warm-starts from it."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from eagle3ft.config import REPO_ROOT, load_config, resolve_path
from eagle3ft.drafter.config import DrafterConfig
from eagle3ft.drafter.export import check_keys, load_drafter
from eagle3ft.drafter.model import DraftCache

SHIPPED = REPO_ROOT / "drafters" / "smollm2-135m"


def test_the_folder_is_what_sglang_loads_bf16_and_at_most_25_mb():
    weights = SHIPPED / "model.safetensors"
    assert weights.stat().st_size <= 25 * 2**20
    cfg = DrafterConfig.from_json(SHIPPED / "config.json")
    with safe_open(weights, framework="pt") as f:
        keys = set(f.keys())
        dtypes = {f.get_tensor(k).dtype for k in keys - {"d2t", "t2d"}}
    check_keys(keys, str(weights), cfg.fc_norm)
    assert "embed_tokens.weight" not in keys
    assert dtypes == {torch.bfloat16}
    # SmolLM2-135M-Instruct: hidden 576, vocab 49152, 30 layers; aux ids as SGLang captures them
    assert (cfg.target_hidden_size, cfg.vocab_size, cfg.draft_vocab_size) == (576, 49152, 8192)
    assert cfg.aux_layer_ids == [1, 14, 26]


def test_the_vocabulary_maps_every_draft_id_to_a_distinct_target_id():
    with safe_open(SHIPPED / "model.safetensors", framework="pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    target_ids = torch.arange(d2t.numel()) + d2t
    assert t2d.dtype == torch.bool and int(t2d.sum()) == d2t.numel()
    assert torch.equal(torch.nonzero(t2d)[:, 0], target_ids)  # sorted, distinct, and exactly the t2d set


def test_the_card_names_data_steps_recipe_commit_and_tau_per_held_out_set():
    """Issue 38's card: all-token and loop-free tau per held-out set, the live end-to-end speed-up on the everyday
    set, and a choosing set that is none of the reported ones."""
    card = json.loads((SHIPPED / "card.json").read_text())
    for key in ("data", "steps", "recipe", "commit", "tau", "live", "chosen_by"):
        assert card.get(key), key
    for held_out in ("everyday", "mtbench"):
        t = card["tau"][held_out]
        assert t["setting_tau_walk"]["3/1/4"] > t["setting_tau_walk_loop_free"]["3/1/4"] > 1.0
    assert not any(name in card["chosen_by"] for name in ("MT-Bench", "everyday"))
    for arm in ("3/1/4", "8/4/32"):
        live = card["live"]["everyday"][arm]
        assert live["speedup"]["bench_serving"] > 0 and live["speedup"]["ours"] > 0 and live["tau"] > 1.0


def test_the_embedded_default_config_warm_starts_from_it_and_it_runs():
    cfg = load_config(REPO_ROOT / "configs" / "smollm2-135m.yaml", [])
    assert resolve_path(cfg.drafter.init) == SHIPPED
    torch.manual_seed(0)
    drafter = load_drafter(SHIPPED, embedding=torch.randn(49152, 576) * 0.02).float().eval()
    ids = torch.randint(0, 49152, (1, 5))  # (B, T)
    aux = torch.randn(1, 5, 3 * 576)  # (B, T, 3Ht)
    with torch.no_grad():
        hidden, logits = drafter.step(ids, drafter.fuse(aux), torch.arange(5)[None], DraftCache())
    assert hidden.shape == (1, 5, 576) and logits.shape == (1, 5, 8192) and torch.isfinite(logits).all()
