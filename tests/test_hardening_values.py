"""Values no stage lets through: non-finite or absurd config rates, NaN or inf drafter weights, bare NaN in JSON; and
the inputs no single record of which stops a stage: prompt records of any depth, size or type, damaged shards, a full
disk."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
from train_fixtures import REPO

from eagle3ft.config import ConfigError, load_config

TINY = REPO / "configs/tiny.yaml"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.optimizer.lr=.inf", "train.optimizer.lr must be a finite number, got inf"),
        ("train.optimizer.lr=1e39", "train.optimizer.lr must be <= 10, got 1e+39"),
        ("train.optimizer.lr=.nan", "train.optimizer.lr must be positive, got nan"),
        ("train.optimizer.max_grad_norm=.inf", "train.optimizer.max_grad_norm must be a finite number, got inf"),
        ("harvest.sglang.timeout_s=.inf", "harvest.sglang.timeout_s must be a finite number, got inf"),
        ("bench.temperature=-.inf", "bench.temperature must be >= 0, got -inf"),
    ],
)
def test_config_refuses_non_finite_and_absurd_rates_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert str(e.value) == message
    load_config(TINY, ["train.optimizer.lr=10"])  # the largest rate let through


def nan_drafter():
    import torch

    from eagle3ft.drafter.config import DrafterConfig
    from eagle3ft.drafter.model import Eagle3Drafter

    torch.manual_seed(0)
    model = Eagle3Drafter(DrafterConfig.from_json(REPO / "configs/drafters/tiny.json"))
    with torch.no_grad():
        model.fc.weight[0, 0] = float("nan")
    return model


def test_an_export_or_checkpoint_is_never_written_with_a_non_finite_tensor(tmp_path):
    from eagle3ft.drafter.export import export_drafter
    from eagle3ft.files import NonFinite

    model = nan_drafter()
    with pytest.raises(
        NonFinite, match=r"/\.export\.tmp: tensor fc\.weight holds 1 non-finite value\(s\) \(NaN or inf\)"
    ):
        export_drafter(model, tmp_path / "export")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "model.safetensors").write_text("the last good export")
    with pytest.raises(NonFinite):
        export_drafter(model, tmp_path / "export")
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    assert (tmp_path / "export" / "model.safetensors").read_text() == "the last good export"
    from test_hardening_train import SavingDist

    from eagle3ft.train.checkpoint import save_checkpoint

    with pytest.raises(NonFinite, match=r"/ckpt/\.step-3\.tmp: tensor fc\.weight holds 1 non-finite"):
        save_checkpoint(SavingDist(), model, model.config, tmp_path, 3, {"step": 3}, keep=0)
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_eval_report_and_both_benches_refuse_a_drafter_with_a_nan_weight_in_one_line(tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file, save_file
    from test_hardening import export, no_compute
    from train_fixtures import write_store

    from eagle3ft.eval.bench.live import main as bench_main
    from eagle3ft.eval.bench.sglang_backend import SGLangBackend
    from eagle3ft.eval.offline.accept_len import main as accept_len_main
    from eagle3ft.eval.report.build import main as report_main
    from eagle3ft.files import NonFinite

    write_store(tmp_path, n_train=2, n_heldout=2)
    weights = export(tmp_path) / "model.safetensors"
    t = load_file(weights)
    t["fc.weight"][3, 5] = float("inf")
    save_file(t, str(weights))
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "acc": [0.5]}\n')  # for the report
    no_compute(monkeypatch)
    line = rf"eval\.checkpoint: the drafter's weights {weights}: tensor fc\.weight holds 1 non-finite value\(s\) \(NaN"
    for main, prog in ((accept_len_main, "accept_len.py"), (bench_main, "live.py"), (report_main, "build.py")):
        with pytest.raises(SystemExit) as e:
            main(["--config", str(TINY), "--run-dir", str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 1 and len(err) == 1 and err[0].startswith(f"{prog}: error: "), (prog, err)
        assert re.search(line, err[0]), err
    with pytest.raises(NonFinite, match=line):  # before any server is started
        SGLangBackend(load_config(TINY, ["bench.backend=sglang", "bench.sglang.launch=true"]), tmp_path)
    assert not (tmp_path / "eval").exists() and not (tmp_path / "bench").exists()


def test_the_json_the_project_writes_is_strict(tmp_path):
    from eagle3ft.files import json_text, write_json

    with pytest.raises(ValueError, match=r"x\.json: settings\[1\]\.tau is not a finite number; strict JSON has no NaN"):
        write_json(tmp_path / "x.json", {"settings": [{"tau": 1.0}, {"tau": float("nan")}]})
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"^metrics: heldout_best_tau is not a finite number"):
        json_text({"step": 1, "heldout_best_tau": -float("inf")}, "metrics")
    assert json_text({"tau": 2.5}, "x") == '{"tau": 2.5}'


# --------------------------------------------------------------------------- prompt records of any depth, size or type


def _conv(i: int) -> str:
    return json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]})


def test_no_single_prompt_record_stops_a_reader_and_each_skip_names_its_file_and_line(tmp_path):
    from eagle3ft.config import SourceConfig
    from eagle3ft.data.prompts import collect
    from eagle3ft.data.readers import Skips

    deep = "[" * 200_000 + "]" * 200_000  # 0.4 MB, under the byte cap; json's decoder recurses into it
    shallow_but_deep = json.dumps(
        {"conversations": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["x"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}
    )
    long_int = '{"turns": [' + "9" * 5000 + "]}"  # json refuses to convert it (ValueError, not a decode error)
    wrong_types = json.dumps({"messages": "hi"}), json.dumps([1, 2]), json.dumps({"conversations": [{"from": 1}]})
    lines = [_conv(0), deep, shallow_but_deep, long_int, *wrong_types, _conv(1)]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    array = tmp_path / "p.json"
    array.write_text("[\n" + ",\n".join(lines) + "\n]")
    for path in (jsonl, array):
        skips = Skips()
        src = SourceConfig(kind="file", path=str(path))
        convs = collect([src], max_turns=1, regenerate=False, heldout_fraction=0.0, dedupe=True, skips=skips)
        assert [c.messages[0]["content"] for c in convs] == ["q0", "q1"]
        assert skips == {"too_deep": 2, "malformed": 4}, (path, skips)
        first = 1 if path == jsonl else 2  # the array's first record is on line 2
        assert skips.at == {
            "too_deep": [f"{path}:{first + 1}", f"{path}:{first + 2}"],
            "malformed": [f"{path}:{first + n}" for n in (3, 4, 5, 6)],
        }


def test_a_chitchat_file_of_wrong_types_is_skipped_record_by_record(tmp_path):
    from eagle3ft.data.prompts import iter_chitchat, normalize
    from eagle3ft.data.readers import Skips

    path = tmp_path / "chats.json"
    good = {"messages": [[{"sender": "a", "text": "hi"}], [{"sender": "b", "text": "hello"}]]}
    bad = [{"messages": ["ab", "cd"]}, {"messages": [[1, 2]]}, {"messages": {"x": 1}}, "text", {"messages": [[{}]]}]
    path.write_text(json.dumps({f"c{i}": c for i, c in enumerate([good, *bad, good])}))
    skips = Skips()
    kept = []
    for record in iter_chitchat(path, skips):
        try:
            kept.append(normalize(record, max_turns=2, regenerate=False))
        except Exception as e:  # normalize's Skip: counted by collect
            assert type(e).__name__ == "Skip", e
    assert len(kept) == 2


def test_a_harvest_over_a_200000_deep_line_skips_it_naming_file_and_line(tmp_path, capsys):
    from eagle3ft.data.harvest import main as harvest_main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join([_conv(0), "[" * 200_000, _conv(1)]) + "\n")
    harvest_main(
        [
            "--config",
            str(TINY),
            "--run-dir",
            str(tmp_path / "run"),
            "--set",
            f"harvest.sources=[{{kind: file, path: {prompts}}}]",
            "--set",
            "harvest.max_new_tokens=4",
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["samples"]["train"] == 2 and summary["skips"]["too_deep"] == 1
    assert summary["skipped_at"] == {"too_deep": [f"{prompts}:2"]}


# --------------------------------------------------------------------------- a full disk, anywhere

FULL_LINE = (
    r"no space left on the file system at /\S* \(\d+\.\d GiB free\): free space there \(or give --run-dir a disk "
)


def fill_disk_at(monkeypatch, suffix: str) -> None:
    """The disk is full when a file whose name ends with `suffix` is flushed (fsync: where a full disk shows)."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(suffix):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("full_at", [".train-00001.safetensors.tmp", ".manifest.json.tmp"])
def test_a_full_disk_stops_a_harvest_in_one_line_and_leaves_nothing_that_looks_valid(
    tmp_path, monkeypatch, capsys, full_at
):
    from eagle3ft.data.harvest import main as harvest_main

    argv = ["--config", str(TINY), "--run-dir", str(tmp_path), "--set", "harvest.sources=[{kind: sharegpt, limit: 2}]"]
    argv += ["--set", "harvest.shard_samples=1", "--set", "harvest.max_new_tokens=4", "--set", "harvest.max_turns=1"]
    fill_disk_at(monkeypatch, full_at)
    with pytest.raises(SystemExit) as e:
        harvest_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    features = tmp_path / "features"
    what = features / full_at[1:].removesuffix(".tmp")
    assert e.value.code == 1 and re.fullmatch(f"harvest: error: {re.escape(str(what))}: {FULL_LINE}.*", err[-1]), err
    assert not any(p.name.endswith(".tmp") for p in features.iterdir())
    listed = (
        json.loads((features / "manifest.json").read_text())["shards"] if (features / "manifest.json").exists() else []
    )
    assert sorted(p.name for p in features.glob("*.safetensors")) == [s["file"] for s in listed]
    monkeypatch.undo()
    harvest_main(argv)  # space freed: the rerun finishes what was not committed
    assert json.loads(capsys.readouterr().out)["samples"]["train"] == 2


@pytest.mark.parametrize("error", ["os", "safetensors"])
def test_a_full_disk_during_a_checkpoint_or_an_export_names_the_file_and_leaves_the_last_good_one(
    tmp_path, monkeypatch, error
):
    from safetensors import SafetensorError
    from test_hardening_train import SavingDist, save_steps, tiny_drafter

    import eagle3ft.drafter.export as export_mod
    import eagle3ft.train.checkpoint as checkpoint_mod
    from eagle3ft.files import DiskFull

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        if error == "os":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space" })'
        )

    save_steps(tmp_path, 2)
    model = tiny_drafter()
    monkeypatch.setattr(checkpoint_mod, "save_file", full)
    with pytest.raises(DiskFull, match=rf"^{re.escape(str(tmp_path / 'ckpt' / '.step-4.tmp'))}/state\.safetensors: "):
        checkpoint_mod.save_checkpoint(SavingDist(), model, model.config, tmp_path, 4, {"step": 4}, keep=0)
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step-2"]
    assert checkpoint_mod.choose_resume(tmp_path, "auto") == (tmp_path / "ckpt" / "step-2", [])

    export_mod.export_drafter(model, tmp_path / "export")
    before = {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()}
    monkeypatch.setattr(export_mod, "save_file", full)
    with pytest.raises(DiskFull, match=rf"/\.export\.tmp/model\.safetensors: {FULL_LINE}"):
        export_mod.export_drafter(model, tmp_path / "export")
    assert {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "export"]
