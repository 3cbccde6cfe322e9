"""eagle3ft/drafter/folder.py: a drafter folder is opened in one place; its config.json is read once per check and
load, its one check names the option and both values on a mismatch, and its kind is config.json's architecture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3ft.drafter.config import LLAMA_EAGLE3, DrafterConfig, DrafterMismatch
from eagle3ft.drafter.export import export_drafter
from eagle3ft.drafter.folder import DrafterFolder
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.run_dir import RunDir

TARGET = {"hidden_size": 64, "vocab_size": 49152, "num_layers": 4}  # configs/drafters/tiny.json's target


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_json("configs/drafters/tiny.json"))
    drafter.t2d[: drafter.config.draft_vocab_size] = True
    return export_drafter(drafter, tmp_path_factory.mktemp("d") / "export")


def test_config_json_is_read_once_for_a_check_and_a_load(folder, monkeypatch):
    reads = []
    real = Path.read_bytes

    def counting(path):
        if path.name == "config.json":
            reads.append(str(path))
        return real(path)

    monkeypatch.setattr(Path, "read_bytes", counting)
    f = DrafterFolder(folder, "eval.checkpoint").check(TARGET, "features/manifest.json")
    model = f.load(torch.zeros(49152, 64))
    assert reads == [str(folder / "config.json")]
    assert model.config is f.config and f.kind == LLAMA_EAGLE3
    assert not model.embed_tokens.weight.any()


def test_a_mismatched_target_is_refused_naming_the_option_the_folder_and_both_values(folder):
    with pytest.raises(DrafterMismatch, match=r"eval\.checkpoint .*export: drafter target_hidden_size 64 != target "):
        DrafterFolder(folder, "eval.checkpoint").check({**TARGET, "hidden_size": 128})
    with pytest.raises(DrafterMismatch, match=r"aux layer ids \[0, 1, 2\] != features' aux layer ids \[1, 2, 3\]"):
        DrafterFolder(folder, "--after").check({**TARGET, "aux_layer_ids": [1, 2, 3]}, "features/manifest.json")


def test_without_a_target_the_vocabulary_and_weights_are_still_checked(folder, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["fc.weight"][0, 0] = float("nan")
    save_file(tensors, str(bad / "model.safetensors"))
    DrafterFolder(folder).check()
    with pytest.raises(ValueError, match=r"bench\.drafters\.b: the drafter's weights"):
        DrafterFolder(bad, "bench.drafters.b").check()


def test_a_folder_without_config_json_is_named_with_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"warm start: .* has no config\.json"):
        DrafterFolder(tmp_path, "warm start")


def test_the_kind_is_the_architecture_and_an_unknown_kind_reads_but_does_not_load(folder, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    raw = json.loads((folder / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**raw, "architectures": ["Eagle3OtherForCausalLM"]}))
    (other / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    f = DrafterFolder(other, "bench.drafters.x")
    assert f.kind == "Eagle3OtherForCausalLM" and f.family == "eagle3"
    with pytest.raises(ValueError, match="holds a Eagle3OtherForCausalLM drafter"):
        f.load()


def test_the_evaluated_drafter_is_resolved_against_the_run_folder(folder, tmp_path):
    run = tmp_path / "run"
    (run / "export").mkdir(parents=True)
    (run / "export" / "config.json").write_text((folder / "config.json").read_text())
    assert DrafterFolder.of_run(run, "export").path == run / "export" == RunDir(run).drafter("export")
    assert DrafterFolder.of_run(run, str(folder)).path == folder
    with pytest.raises(ValueError, match="eval.checkpoint: name the drafter folder"):
        DrafterFolder.of_run(run, "")


def test_load_like_puts_the_drafter_beside_the_target(folder):
    emb = torch.randn(49152, 64).double()  # float32 values: the load goes through float32
    model = DrafterFolder(folder).load_like(emb)
    assert model.fc.weight.dtype == torch.float64 and not model.training
    assert torch.equal(model.embed_tokens.weight, emb)
