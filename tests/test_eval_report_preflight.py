"""An eval or bench stage on a run folder without its inputs stops at once, before loading the target, with one
line that names what is missing and the command that makes it."""

import pytest

from eagle3ft.config import load_config
from eagle3ft.eval import preflight
from eagle3ft.eval.bench import live
from eagle3ft.eval.economics import analysis
from eagle3ft.eval.offline import accept_len
from eagle3ft.eval.report import build
from eagle3ft.targets import hf

CONFIG = "configs/tiny.yaml"


@pytest.fixture(autouse=True)
def no_target(monkeypatch):
    """Loading the target (or its tokenizer) is what the preflight must come before."""

    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the preflight")

    for name in ("load_target", "load_input_embedding", "load_tokenizer"):
        monkeypatch.setattr(hf, name, refuse)


def _stop(main, run, capsys, *sets: str) -> str:
    argv = ["--config", CONFIG, "--run-dir", str(run)] + [a for s in sets for a in ("--set", s)]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")


def test_offline_eval_needs_features_then_a_drafter(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()  # an empty folder: the read-side stages do not create one (eagle3ft/cli.py)
    err = _stop(accept_len.main, run, capsys)
    assert (
        err.startswith("accept_len.py: error: no ") and "features/manifest.json: harvest first: eagle3ft harvest" in err
    )
    _touch(run / "features" / "manifest.json")
    err = _stop(accept_len.main, run, capsys)
    assert f"no drafter at {run / 'export'}: train one: eagle3ft train --config" in err
    assert f"eagle3ft train --config {CONFIG} --run-dir {run} --resume auto" in err


def test_a_run_cut_short_before_the_export_is_told_to_resume(tmp_path, capsys):
    run = tmp_path / "run"
    _touch(run / "features" / "manifest.json")
    for n in (4, 12, 8):
        (run / "ckpt" / f"step-{n}").mkdir(parents=True)
    assert "training stopped at ckpt/step-12 before the export; resume it: eagle3ft train --config" in _stop(
        accept_len.main, run, capsys
    )
    _touch(run / "export" / "config.json")  # an export cut short
    assert f"{run / 'export'} has no model.safetensors" in _stop(accept_len.main, run, capsys)


@pytest.mark.parametrize(
    "sets", [[], ["bench.backend=sglang", "bench.sglang.launch=true"]], ids=["bench", "bench_sglang"]
)
def test_bench_needs_a_drafter(tmp_path, capsys, sets):
    run = tmp_path / "run"
    run.mkdir()  # an empty folder: the read-side stages do not create one (eagle3ft/cli.py)
    err = _stop(live.main, run, capsys, *sets)
    assert err.startswith("live.py: error: no drafter at") and "eagle3ft train --config" in err
    elsewhere = tmp_path / "nowhere"
    err = _stop(live.main, run, capsys, *sets, f"eval.checkpoint={elsewhere}")
    assert f"no drafter at {elsewhere} (eval.checkpoint): point --set eval.checkpoint=DIR" in err


def test_running_sglang_servers_need_no_local_drafter(tmp_path):
    cfg = load_config(CONFIG, ["bench.backend=sglang", "bench.sglang.speculative_url=http://127.0.0.1:1"])
    assert preflight.check("bench", cfg.eval, cfg.bench, tmp_path, CONFIG) is None
    cfg.bench.sglang.launch = True  # the launcher starts the EAGLE3 servers with eval.checkpoint
    assert "no drafter at" in preflight.check("bench", cfg.eval, cfg.bench, tmp_path, CONFIG)


def test_bench_checks_the_calibration_file_before_it_starts(tmp_path, capsys):
    run = tmp_path / "run"
    _touch(run / "export" / "config.json")
    _touch(run / "export" / "model.safetensors")
    err = _stop(live.main, run, capsys, f"bench.calibration={tmp_path / 'cal.json'}")
    assert f"no calibration file {tmp_path / 'cal.json'} (bench.calibration)" in err


def test_economics_and_report_name_the_stage_that_makes_their_input(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()  # an empty folder: the read-side stages do not create one (eagle3ft/cli.py)
    assert "no drafter at" in _stop(analysis.main, run, capsys)
    assert "no drafter at" in _stop(build.main, run, capsys)
    _touch(run / "export" / "config.json")
    _touch(run / "export" / "model.safetensors")
    assert f"bench/summary.json: run eagle3ft bench --config {CONFIG} --run-dir {run}" in _stop(
        analysis.main, run, capsys
    )
    assert "nothing to report" in _stop(build.main, run, capsys) and "run eagle3ft eval --config" in _stop(
        build.main, run, capsys
    )
    _touch(tmp_path / "cal.json")
    err = _stop(analysis.main, run, capsys, f"bench.calibration={tmp_path / 'cal.json'}")
    assert "eval/accept_len.json: run eagle3ft eval" in err


def test_a_stage_run_as_eagle3ft_names_that_command_in_its_errors(tmp_path, monkeypatch, capsys):
    """`eagle3ft bench` (and its alias eagle3ft-bench) names itself in its errors, not the file behind it."""
    from eagle3ft.commands import main

    monkeypatch.setattr("sys.argv", ["eagle3ft"])
    (tmp_path / "run").mkdir()  # an empty folder: the read-side stages do not create one (eagle3ft/cli.py)
    with pytest.raises(SystemExit) as e:
        main(["bench", "--config", CONFIG, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("eagle3ft bench: error: no drafter at"), err
