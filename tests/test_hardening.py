"""Every bad input named before any compute: the drafter checked against the features in one place (train, offline
eval, the benches), truncated files named in one line by the entry points, the warm-start vocabulary adopted by the
run, a damaged complete store reported by a harvest rerun."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_train_checkpoint import write_k2_like
from train_fixtures import REPO, TINY_TARGET, write_store

from eagle3ft.config import load_config
from eagle3ft.drafter.config import DrafterConfig, DrafterMismatch, check_drafter
from eagle3ft.drafter.export import export_drafter
from eagle3ft.drafter.model import Eagle3Drafter
from eagle3ft.drafter.vocab import build_vocab, load_vocab, save_vocab

TINY = REPO / "configs/tiny.yaml"
TINY_DRAFTER = json.loads((REPO / "configs/drafters/tiny.json").read_text())


def no_compute(monkeypatch):
    """Loading the target (or its embedding) fails the test: the checks must come first."""
    import eagle3ft.targets.hf as hf

    def boom(*a, **k):
        raise AssertionError("the target was loaded before the drafter was checked")

    for name in ("load_target", "load_input_embedding"):
        monkeypatch.setattr(hf, name, boom)


def export(run: Path, **over) -> Path:
    """run/export: a drafter of configs/drafters/tiny.json (with `over`) carrying the run's vocabulary."""
    cfg = DrafterConfig.from_dict({**TINY_DRAFTER, **over})
    torch.manual_seed(0)
    m = Eagle3Drafter(cfg)
    d2t, t2d = load_vocab(run / "vocab.safetensors")
    with torch.no_grad():
        m.d2t.copy_(d2t)
        m.t2d.copy_(t2d)
    return export_drafter(m, run / "export")


@pytest.fixture
def run(tmp_path):
    write_store(tmp_path, n_train=2, n_heldout=2)
    return tmp_path


def test_one_check_for_targets_and_features():
    spec = DrafterConfig.from_json(REPO / "configs/drafters/tiny.json")
    assert check_drafter(spec, TINY_TARGET, "w", "m.json") == [0, 1, 2]
    cfg = DrafterConfig.from_dict({**TINY_DRAFTER, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}})
    with pytest.raises(
        DrafterMismatch,
        match=r"^w: drafter aux layer ids \[0, 1, 3\] != features' aux layer ids \[0, 1, 2\] \(m\.json\)$",
    ):
        check_drafter(cfg, TINY_TARGET, "w", "m.json")
    assert check_drafter(cfg, {**TINY_TARGET, "aux_layer_ids": None}, "w") == [
        0,
        1,
        3,
    ]  # a live target has no ids of its own
    with pytest.raises(DrafterMismatch, match=r"drafter target_hidden_size 96 != features' target hidden_size 64"):
        check_drafter(DrafterConfig.from_dict({**TINY_DRAFTER, "target_hidden_size": 96}), TINY_TARGET, "w", "m.json")
    with pytest.raises(
        DrafterMismatch, match=r"drafter draft_vocab_size 60000 not in \(0, features' target vocab_size 49152\]"
    ):
        check_drafter(DrafterConfig.from_dict({**TINY_DRAFTER, "draft_vocab_size": 60000}), TINY_TARGET, "w", "m.json")
    d2t, t2d = build_vocab(torch.arange(49152), 512)
    check_drafter(spec, TINY_TARGET, "w", "m.json", d2t, t2d)
    d2t[-1] += 10**6
    with pytest.raises(ValueError, match=r"^w: draft vocabulary: d2t maps 1 draft ids outside the target vocab"):
        check_drafter(spec, TINY_TARGET, "w", "m.json", d2t, t2d)


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}},
            r"drafter aux layer ids \[0, 1, 3\] != features' aux layer ids \[0, 1, 2\] \(.*manifest\.json\)",
        ),
        ({"target_hidden_size": 96}, r"drafter target_hidden_size 96 != features' target hidden_size 64"),
        (
            "truncate",
            r"export/model\.safetensors: the drafter's weights file is not a readable safetensors file \(.*\); the "
            r"file is truncated or damaged",
        ),
        ("t2d", r"draft vocabulary: d2t and t2d disagree"),
    ],
)
def test_offline_eval_refuses_a_bad_drafter_in_one_line_before_compute(run, damage, message, monkeypatch, capsys):
    from eagle3ft.eval.offline.accept_len import main

    folder = export(run, **(damage if isinstance(damage, dict) else {}))
    weights = folder / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    if damage == "t2d":
        t = load_file(weights)
        t["t2d"][int(torch.nonzero(t["t2d"])[0])] = False
        save_file(t, str(weights))
    no_compute(monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(["--config", str(TINY), "--run-dir", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        e.value.code == 1
        and len(err) == 1
        and err[0].startswith("accept_len.py: error: ")
        and re.search(message, err[0])
    ), err
    assert not (run / "eval" / "accept_len.json").exists()


def test_the_benches_refuse_a_drafter_that_disagrees_with_the_features_before_compute(run, monkeypatch, capsys):
    from eagle3ft.eval.bench.live import main
    from eagle3ft.eval.bench.sglang_backend import SGLangBackend

    export(run, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]})
    no_compute(monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(["--config", str(TINY), "--run-dir", str(run)])
    err = capsys.readouterr().err.strip()
    assert (
        e.value.code == 1
        and err.startswith("live.py: error: eval.checkpoint ")
        and "drafter aux layer ids [0, 1, 3] != features' aux layer ids [0, 1, 2]" in err
    )
    cfg = load_config(TINY, ["bench.backend=sglang", "bench.sglang.launch=true"])
    with pytest.raises(DrafterMismatch, match=r"aux layer ids \[0, 1, 3\]"):  # before any server is started
        SGLangBackend(cfg, run)


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            "d2t_range",
            r"warm start .*/k2: draft vocabulary: d2t maps 1 draft ids outside the target vocab \[0, 49152\)",
        ),
        ("t2d", r"warm start .*/k2: draft vocabulary: d2t and t2d disagree"),
        ("truncate", r"k2/model\.safetensors: the drafter's weights file is not a readable safetensors file"),
    ],
)
def test_train_refuses_a_bad_warm_start_drafter_in_one_line_before_compute(run, damage, message, monkeypatch, capsys):
    from eagle3ft.train.finetune import main

    tensors = write_k2_like(run / "k2")
    weights = run / "k2" / "model.safetensors"
    if damage == "d2t_range":
        tensors["d2t"][-1] = 10**6
        save_file(tensors, str(weights))
    if damage == "t2d":
        tensors["t2d"][int(torch.nonzero(tensors["t2d"])[0])] = False
        save_file(tensors, str(weights))
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: len(weights.read_bytes()) // 2])
    no_compute(monkeypatch)
    with pytest.raises(SystemExit) as e:
        main(
            [
                "--config",
                str(TINY),
                "--run-dir",
                str(run),
                "--set",
                f"drafter.init={run / 'k2'}",
                "--set",
                "train.logging.wandb_mode=disabled",
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        e.value.code == 1 and len(err) == 1 and err[0].startswith("finetune: error: ") and re.search(message, err[0])
    ), err


def test_scratch_training_refuses_an_inconsistent_run_vocab(run, monkeypatch):
    from eagle3ft.train.build import build_drafter

    d2t, t2d = load_vocab(run / "vocab.safetensors")
    t2d[int(torch.nonzero(~t2d)[0])] = True  # one more marked than d2t maps
    save_vocab(run / "vocab.safetensors", d2t, t2d)
    no_compute(monkeypatch)
    cfg = load_config(TINY)
    with pytest.raises(
        ValueError,
        match=r"vocab\.safetensors: draft vocabulary: d2t and t2d disagree: t2d marks 513 target ids, d2t maps 512",
    ):
        build_drafter(cfg.drafter, cfg.target, run, TINY_TARGET)
    (run / "vocab.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(
        ValueError, match=r"vocab\.safetensors: the draft vocabulary is not a readable safetensors file"
    ):
        build_drafter(cfg.drafter, cfg.target, run, TINY_TARGET)


def test_warm_start_rewrites_the_run_vocab_with_the_drafters(run):
    from eagle3ft.train.build import adopt_drafter_vocab

    init = write_k2_like(run / "k2")
    note = adopt_drafter_vocab(run, init["d2t"], init["t2d"], run / "k2")
    assert note and "had 512 draft tokens, the drafter 256; rewrote it with the warm-start drafter's d2t/t2d" in note
    d2t, t2d = load_vocab(run / "vocab.safetensors")
    assert torch.equal(d2t, init["d2t"]) and torch.equal(t2d, init["t2d"])
    assert adopt_drafter_vocab(run, init["d2t"], init["t2d"], run / "k2") is None  # already the drafter's: left alone
    other = init["d2t"].clone()
    other[[0, 1]] = other[[1, 0]] + torch.tensor([1, -1])  # swap the first two target ids
    save_vocab(run / "vocab.safetensors", other, init["t2d"])
    assert "differed from it in 2 of 256 d2t and 0 of 49152 t2d entries" in adopt_drafter_vocab(
        run, init["d2t"], init["t2d"], run / "k2"
    )
    (run / "vocab.safetensors").write_bytes(b"junk")
    assert "was unreadable" in adopt_drafter_vocab(run, init["d2t"], init["t2d"], run / "k2")
    assert torch.equal(load_vocab(run / "vocab.safetensors")[0], init["d2t"])


def test_harvest_rerun_over_a_damaged_complete_store_redoes_the_damaged_chunks(tmp_path, capsys):
    from eagle3ft.data.harvest import main

    argv = [
        "--config",
        str(TINY),
        "--run-dir",
        str(tmp_path),
        "--set",
        "harvest.sources=[{kind: sharegpt, limit: 2}]",
        "--set",
        "harvest.shard_samples=1",
        "--set",
        "harvest.max_new_tokens=8",
        "--set",
        "harvest.max_turns=1",
    ]
    main(argv)
    first = json.loads(capsys.readouterr().out)
    assert first["argmax_check"]["checked"] > 0 and first["argmax_check"]["mismatched"] == 0
    features = tmp_path / "features"
    manifest = features / "manifest.json"
    whole = {p.name: p.read_bytes() for p in features.glob("*.safetensors")}
    kept = {k: v for k, v in json.loads(manifest.read_text()).items() if k not in ("time_s",)}
    main(argv)  # a rerun over an intact complete store succeeds and resumes every chunk
    assert json.loads(capsys.readouterr().out)["chunks_resumed"] == first["chunks"]
    shard = features / "train-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    (features / "train-00000.safetensors").unlink()
    main(argv)
    out = capsys.readouterr()
    assert (
        f"harvest: {features}: 2 committed shard(s) damaged or missing (train-00000.safetensors: missing; "
        "train-00001.safetensors: fails its sha256 check): their chunks are harvested again"
    ) in out.err
    again = json.loads(out.out)
    assert again["chunks_resumed"] == first["chunks"] - 2
    assert {k: again[k] for k in ("samples", "tokens", "loss_tokens", "skips", "argmax_check")} == {
        k: first[k] for k in ("samples", "tokens", "loss_tokens", "skips", "argmax_check")
    }
    assert {p.name: p.read_bytes() for p in features.glob("*.safetensors")} == whole  # the same shards again
    assert {k: v for k, v in json.loads(manifest.read_text()).items() if k not in ("time_s",)} == kept
    manifest.write_bytes(manifest.read_bytes()[:200])
    with pytest.raises(SystemExit):
        main(argv)
    assert re.search(
        rf"^harvest: error: {re.escape(str(manifest))}: the feature store's manifest is not valid JSON",
        capsys.readouterr().err.strip().splitlines()[-1],
    )
