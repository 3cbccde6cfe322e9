"""The config system: strict keys, dotted overrides, resolved config in the run folder."""

import os
from pathlib import Path

import pytest
import yaml

from eagle3ft.cli import parse_cli
from eagle3ft.config import REPO_ROOT, Config, ConfigError, load_config, to_dict
from eagle3ft.config_build import coerce

SHIPPED = sorted((REPO_ROOT / "configs").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_file_values(tmp_path):
    cfg = load_config(write(tmp_path, "run_name: x\ntrain:\n  lr: 3.0e-4\n  ttt_steps: 5\n"))
    assert isinstance(cfg, Config)
    assert cfg.run_name == "x" and cfg.train.optimizer.lr == 3e-4 and cfg.train.objective.ttt_steps == 5
    assert cfg.train.objective.step_decay == 0.8  # untouched default


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.learning_rate"):
        load_config(write(tmp_path, "train:\n  learning_rate: 1\n"))
    with pytest.raises(ConfigError, match=r"'bogus'"):
        load_config(write(tmp_path, "bogus: 1\n"))


def test_unknown_key_in_list_item_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"harvest\.sources\[0\]\.lmit"):
        load_config(write(tmp_path, "harvest:\n  sources:\n    - kind: sharegpt\n      lmit: 3\n"))


def test_dotted_overrides_parse_yaml_values(tmp_path):
    p = write(tmp_path, "train:\n  lr: 1.0e-4\n")
    cfg = load_config(
        p, ["train.lr=2e-3", "train.max_steps=7", "harvest.sources=[{kind: mtbench, limit: 2}]", "train.resume=auto"]
    )
    assert (
        cfg.train.optimizer.lr == 2e-3 and cfg.train.schedule.max_steps == 7 and cfg.train.checkpoint.resume == "auto"
    )
    assert cfg.harvest.sources[0].kind == "mtbench" and cfg.harvest.sources[0].limit == 2
    with pytest.raises(ConfigError, match=r"train\.nope"):
        load_config(p, ["train.nope=1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(p, ["train.lr"])


def test_wrong_types_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.objective\.ttt_steps"):
        load_config(write(tmp_path, "train:\n  objective:\n    ttt_steps: seven\n"))
    with pytest.raises(ConfigError, match=r"harvest\.regenerate"):
        load_config(write(tmp_path, "harvest:\n  regenerate: 1\n"))


def test_enumerated_values_are_checked_at_load(tmp_path):
    with pytest.raises(ConfigError, match=r"bench\.warmup: 'some' is not one of all, first"):
        load_config(write(tmp_path, "bench:\n  warmup: some\n"))
    with pytest.raises(ConfigError, match=r"harvest\.sources\[1\]\.kind: 'mtbnch' is not one of sharegpt, mtbench"):
        load_config(None, ["harvest.sources=[{kind: sharegpt}, {kind: mtbnch}]"])
    with pytest.raises(ConfigError, match=r"eval\.tree_context: 'tree' is not one of slots, ancestors"):
        load_config(None, ["eval.tree_context=tree"])
    cfg = load_config(None, ["eval.tree_context=ancestors", "train.loss=lk_hybrid", "serve.harvest_capture=aux_flag"])
    assert (cfg.eval.tree_context, cfg.train.objective.loss, cfg.serve.harvest_capture) == (
        "ancestors",
        "lk_hybrid",
        "aux_flag",
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_steps=-5", "train.schedule.max_steps must be positive or null, got -5"),
        ("train.max_steps=0", "train.schedule.max_steps must be positive or null, got 0"),
        ("train.epochs=0", "train.schedule.epochs must be positive, got 0"),
        ("train.micro_batch_size=0", "train.batch.micro_batch_size must be positive, got 0"),
        ("train.grad_accum=-1", "train.batch.grad_accum must be positive, got -1"),
        ("train.ttt_steps=0", "train.objective.ttt_steps must be positive, got 0"),
        ("train.save_every=0", "train.checkpoint.save_every must be positive, got 0"),
        ("train.eval_every=-1", "train.heldout.eval_every must be >= 0, got -1"),
        ("train.eval_samples=0", "train.heldout.eval_samples must be positive, got 0"),
        ("train.keep_checkpoints=-1", "train.checkpoint.keep_checkpoints must be >= 0, got -1"),
        ("train.warmup_steps=-2", "train.schedule.warmup_steps must be >= 0, got -2"),
        ("train.lr=0", "train.optimizer.lr must be positive, got 0.0"),
        ("train.min_lr_ratio=1.5", "train.schedule.min_lr_ratio must be <= 1, got 1.5"),
        ("bench.repetitions=0", "bench.repetitions must be positive, got 0"),
        ("bench.max_new_tokens=0", "bench.max_new_tokens must be positive, got 0"),
        ("bench.concurrency=[1, 0]", r"bench.concurrency must be positive, got \[1, 0\]"),
        ("bench.settings=[{steps: 0}]", r"bench.settings\[0\].steps must be positive, got 0"),
        ("harvest.batch_size=0", "harvest.batch_size must be positive, got 0"),
        ("harvest.max_new_tokens=0", "harvest.max_new_tokens must be positive, got 0"),
        ("harvest.topk=0", "harvest.topk must be positive, got 0"),
        ("harvest.top_p=0", "harvest.top_p must be positive, got 0.0"),
        ("harvest.heldout_fraction=1.5", "harvest.heldout_fraction must be <= 1, got 1.5"),
        ("harvest.sglang.concurrency=0", "harvest.sglang.concurrency must be positive, got 0"),
        ("harvest.sources=[{kind: mtbench, limit: 0}]", r"harvest.sources\[0\].limit must be positive or null, got 0"),
        ("eval.steps=0", "eval.steps must be positive, got 0"),
        ("eval.temperature=-1", "eval.temperature must be >= 0, got -1.0"),
        ("serve.port=70000", "serve.port must be <= 65535, got 70000"),
        ("target.tiny.hidden_size=0", "target.tiny.hidden_size must be positive, got 0"),
    ],
)
def test_counts_and_rates_outside_their_bounds_are_refused_at_load_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=rf"^{message}$"):
        load_config(REPO_ROOT / "configs/tiny.yaml", [override])


def test_bounds_hold_for_a_config_built_in_code_and_after_replace():
    import dataclasses

    from eagle3ft.config import BenchConfig
    from eagle3ft.config_train import BatchConfig

    cfg = Config()
    with pytest.raises(ConfigError, match=r"^ScheduleConfig\.max_steps must be positive or null, got -5$"):
        dataclasses.replace(cfg.train.schedule, max_steps=-5)
    with pytest.raises(ConfigError, match=r"^BatchConfig\.micro_batch_size must be positive, got 0$"):
        BatchConfig(micro_batch_size=0)
    with pytest.raises(ConfigError, match=r"^BenchConfig\.repetitions must be positive, got 0$"):
        BenchConfig(repetitions=0)
    ok = load_config(None, ["train.max_steps=null", "train.eval_every=0", "train.keep_checkpoints=0"])
    t = ok.train
    assert (t.schedule.max_steps, t.heldout.eval_every, t.checkpoint.keep_checkpoints) == (None, 0, 0)


def test_finetune_refuses_a_negative_max_steps_in_one_line_before_anything_runs(tmp_path, capsys):
    from eagle3ft.train.finetune import main

    with pytest.raises(SystemExit) as e:
        main(
            [
                "--config",
                str(REPO_ROOT / "configs/tiny.yaml"),
                "--run-dir",
                str(tmp_path),
                "--set",
                "train.schedule.max_steps=-5",
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1
    assert err[0].endswith(".py: error: train.schedule.max_steps must be positive or null, got -5"), err
    assert list(tmp_path.iterdir()) == []


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_parse_cli_writes_resolved_config_with_code_version(tmp_path):
    p = write(tmp_path, "run_name: cli\n")
    run = tmp_path / "run"
    cfg, run_dir, _ = parse_cli("t", "harvest", ["--config", str(p), "--run-dir", str(run), "--set", "seed=5"])
    assert cfg.seed == 5 and run_dir == run
    parse_cli("t", "train", ["--config", str(p), "--run-dir", str(run)])
    doc = yaml.safe_load((run / "config.yaml").read_text())
    assert set(doc["stages"]) == {"harvest", "train"}
    assert doc["stages"]["harvest"]["config"]["seed"] == 5
    assert doc["stages"]["harvest"]["code_version"].startswith("0.")


def test_parse_cli_bad_override_exits_with_message(tmp_path, capsys):
    p = write(tmp_path, "run_name: cli\n")
    with pytest.raises(SystemExit) as e:
        parse_cli("t", "harvest", ["--config", str(p), "--run-dir", str(tmp_path / "r"), "--set", "train.zzz=1"])
    assert e.value.code == 2
    assert "train.zzz" in capsys.readouterr().err


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert (REPO_ROOT / cfg.drafter.config).is_file()


def test_yaml_syntax_errors_name_the_file_or_the_set_and_the_line(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"c\.yaml: line 4, column 12: YAML syntax error: while parsing a flow sequence \(line 3, column 7\)",
    ) as e:
        load_config(write(tmp_path, "run_name: x\ntrain:\n  lr: [1, 2\n  ttt_steps: 3\n"))
    assert "\n" not in str(e.value)
    with pytest.raises(
        ConfigError, match=r"--set 'harvest.sources=\[\{kind: x': line 1, column \d+: YAML syntax error"
    ):
        load_config(write(tmp_path, "run_name: x\n"), ["harvest.sources=[{kind: x"])


def test_an_empty_value_is_refused_for_required_keys_and_means_none_for_optional_ones(tmp_path):
    p = write(tmp_path, "run_name: x\n")
    with pytest.raises(ConfigError, match=r"harvest\.sources: a value is required"):
        load_config(p, ["harvest.sources="])
    assert load_config(p, ["train.schedule.max_steps="]).train.schedule.max_steps is None
    with pytest.raises(ConfigError, match=r"train\.optimizer\.lr: a value is required"):
        load_config(write(tmp_path, "train:\n  optimizer:\n    lr:\n"))
    cfg = load_config(write(tmp_path, "harvest:\n  # every key commented out\ntrain:\n"))
    assert cfg.harvest.topk == Config().harvest.topk and cfg.train.optimizer.lr == Config().train.optimizer.lr


def test_not_utf8_config_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"run_name: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: not UTF-8"):
        load_config(p)


def test_cli_errors_print_one_line_and_the_traceback_only_with_debug(monkeypatch, capsys):
    from eagle3ft.cli import DEBUG_ENV, cli_errors

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit) as e:
        with cli_errors("prog"):
            raise ValueError("runs/x/vocab.safetensors: the draft vocabulary is truncated\n(detail)")
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err == "prog: error: runs/x/vocab.safetensors: the draft vocabulary is truncated (detail)\n"
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(SystemExit):
        with cli_errors("prog"):
            raise FileNotFoundError("gone")
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("prog: error: gone\n")
    with pytest.raises(KeyError):  # not an input error: a bug keeps its traceback
        with cli_errors("prog"):
            raise KeyError("x")
    monkeypatch.delenv(DEBUG_ENV)
    with pytest.raises(SystemExit) as e:
        with cli_errors("prog"):
            raise KeyboardInterrupt
    assert e.value.code == 130 and capsys.readouterr().err == "prog: interrupted\n"


def test_debug_flag_sets_the_env_for_cli_errors(tmp_path, monkeypatch):
    from eagle3ft.cli import DEBUG_ENV

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    parse_cli(
        "t",
        "harvest",
        ["--config", str(write(tmp_path, "run_name: x\n")), "--run-dir", str(tmp_path / "r"), "--debug"],
        record=False,
    )
    assert os.environ[DEBUG_ENV] == "1"


def test_train_keys_are_written_grouped_as_the_code_reads_them(tmp_path):
    """train: groups its fields by concern (eagle3ft/config_train.py); a file and --set write the code's path
    (`train.optimizer.lr`), and a resolved config is written grouped and loads back to the same config."""
    cfg = load_config(
        None, ["train.optimizer.lr=3e-4", "train.checkpoint.save_every=7", "train.heldout.best_on={a: 1}"]
    )
    t = cfg.train
    assert (t.optimizer.lr, t.checkpoint.save_every, t.heldout.best_on) == (3e-4, 7, {"a": 1.0})
    written = to_dict(cfg)["train"]
    assert written["optimizer"]["lr"] == 3e-4 and "lr" not in written
    assert coerce(Config, to_dict(cfg), "") == cfg
    text = "train:\n  optimizer:\n    lr: 5.0e-4\n  batch: {max_len: 64}\n"
    assert load_config(write(tmp_path, text), []).train.batch.max_len == 64
    with pytest.raises(ConfigError, match=r"^unknown config key 'train\.optimizer\.rate' \(known: "):
        load_config(None, ["train.optimizer.rate=1"])
    with pytest.raises(ConfigError, match=r"^train\.optimizer\.lr must be positive, got -1\.0$"):
        load_config(None, ["train.optimizer.lr=-1"])


def test_flat_train_keys_are_aliases_read_with_a_one_line_notice(tmp_path, capsys):
    """Configs users already have write `train.lr`: read as train.optimizer.lr, one stderr line per file or --set."""
    import dataclasses
    import typing

    from eagle3ft.config_train import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    groups = [g.name for g in dataclasses.fields(TrainConfig)]
    names = [f.name for g in groups for f in dataclasses.fields(hints[g])]
    assert len(names) == len(set(names)) and not set(names) & set(groups)  # each flat name stands for one field
    cfg = load_config(write(tmp_path, "train:\n  lr: 2.0e-3\n  save_every: 7\n"), ["train.max_len=99"])
    assert (cfg.train.optimizer.lr, cfg.train.checkpoint.save_every, cfg.train.batch.max_len) == (2e-3, 7, 99)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert "train.lr as train.optimizer.lr, train.save_every as train.checkpoint.save_every" in err[0]
    assert "--set train.max_len as train.batch.max_len" in err[1]
    assert load_config(None, ["train.lr=4e-4"]) == load_config(None, ["train.optimizer.lr=4e-4"])
    with pytest.raises(ConfigError, match=r"^train\.lr and train\.optimizer\.lr are both set"):
        load_config(write(tmp_path, "train:\n  lr: 1.0e-3\n  optimizer: {lr: 2.0e-3}\n"), [])


def test_the_sglang_bench_timeout_is_its_own_key_and_the_harvest_one_is_still_read_for_it(tmp_path, capsys):
    """bench.sglang.timeout_s is the bench's; a config that set only harvest.sglang.timeout_s (which the bench read
    before) gives the bench that value too, with one notice; written beside it, the bench's own key wins."""
    assert load_config(None, ["bench.sglang.timeout_s=30"]).harvest.sglang.timeout_s == 600.0
    assert capsys.readouterr().err == ""
    for path, sets in [
        (write(tmp_path, "harvest:\n  sglang: {timeout_s: 1800}\n"), []),
        (None, ["harvest.sglang.timeout_s=1800"]),
        (None, ["harvest.sglang={timeout_s: 1800}"]),
    ]:
        cfg = load_config(path, sets)
        assert (cfg.harvest.sglang.timeout_s, cfg.bench.sglang.timeout_s) == (1800.0, 1800.0)
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "read harvest.sglang.timeout_s as bench.sglang.timeout_s" in err[0], err
    cfg = load_config(write(tmp_path, "harvest:\n  sglang: {timeout_s: 1800}\n"), ["bench.sglang.timeout_s=20"])
    assert (cfg.harvest.sglang.timeout_s, cfg.bench.sglang.timeout_s) == (1800.0, 20.0)
    assert capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match=r"^bench\.sglang\.timeout_s must be positive"):
        load_config(None, ["bench.sglang.timeout_s=0"])
