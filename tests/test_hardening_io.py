"""Issue 41, round three: prompt files read within a byte cap, one error line whatever the launcher, loopback sockets,
links at temporary names, refused stages that change nothing, `make help`."""

import json
import os
import re
import socket
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
from train_fixtures import launch, write_store

from eagle3ft.config import REPO_ROOT, SourceConfig
from eagle3ft.data.harvest import main as harvest_main
from eagle3ft.data.prompts import collect, iter_chitchat
from eagle3ft.data.readers import MAX_RECORD_BYTES
from eagle3ft.data.store import FeatureStore
from eagle3ft.train.launcher import loopback_only

TINY = REPO_ROOT / "configs" / "tiny.yaml"


def test_a_link_planted_at_a_shards_temporary_name_is_not_written_through(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me")
    run = tmp_path / "run"
    (run / "features").mkdir(parents=True)
    for name in (".train-00000.safetensors.tmp", ".manifest.json.tmp"):
        (run / "features" / name).symlink_to(outside)
    write_store(run, n_train=2, n_heldout=1)
    assert outside.read_bytes() == b"keep me"
    store = FeatureStore(run / "features")
    assert len(store.dataset("train")) == 2
    assert not any(p.is_symlink() for p in (run / "features").iterdir())


def test_a_link_at_the_final_name_is_replaced_not_followed(tmp_path):
    from eagle3ft.files import write_atomic

    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").symlink_to(outside)
    write_atomic(tmp_path / "run" / "summary.json", '{"a": 1}')
    assert outside.read_text() == "{}"
    assert not (tmp_path / "run" / "summary.json").is_symlink()
    assert (tmp_path / "run" / "summary.json").read_text() == '{"a": 1}'


def test_a_harvest_refused_for_another_store_leaves_config_yaml_as_it_was(tmp_path, capsys):
    run = tmp_path / "run"
    write_store(run, n_train=2, n_heldout=1)  # a store of another harvest (topk 4, fingerprint synthetic-0)
    (run / "config.yaml").write_text("stages:\n  harvest: {code_version: before}\n")
    before = {p.name: p.read_bytes() for p in (run / "features").iterdir()}
    with pytest.raises(SystemExit) as e:
        harvest_main(
            ["--config", str(TINY), "--run-dir", str(run), "--set", "harvest.sources=[{kind: mtbench, limit: 2}]"]
        )
    assert e.value.code == 1
    assert "holds a harvest with another" in capsys.readouterr().err
    assert (run / "config.yaml").read_text() == "stages:\n  harvest: {code_version: before}\n"
    assert {p.name: p.read_bytes() for p in (run / "features").iterdir()} == before


def test_make_help_is_the_default_and_lists_every_target_with_a_line():
    makefile = (REPO_ROOT / "Makefile").read_text()
    phony = re.search(r"^\.PHONY: (.*)$", makefile, re.M).group(1).split()
    for argv in (["make", "-s", "help"], ["make", "-s"]):
        out = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=True).stdout
        listed = {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines() if line.strip()}
        assert sorted(listed) == sorted(phony)
        assert all(len(text) > 5 for text in listed.values())


def _conv(i: int) -> bytes:
    return json.dumps(
        {"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
    ).encode()


def _giant(f, mb: int) -> None:
    """One ShareGPT record of `mb` MB whose text holds quotes, brackets and backslashes, written 1 MB at a time."""
    f.write(b'{"conversations": [{"from": "human", "value": "')
    piece = b'x \\" ] } [ { \\\\ ' * ((1 << 20) // 16)
    for _ in range(mb):
        f.write(piece)
    f.write(b'"}, {"from": "gpt", "value": "a"}]}')


def _collect_peak(path) -> tuple[list, Counter, int]:
    skips: Counter = Counter()
    src = SourceConfig(kind="file", path=str(path))
    tracemalloc.start()
    try:
        convs = collect([src], max_turns=1, regenerate=False, heldout_fraction=0.0, dedupe=True, skips=skips)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return convs, skips, peak


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_line_or_record_far_over_the_cap_is_skipped_in_bounded_memory(tmp_path, suffix):
    path = tmp_path / f"prompts{suffix}"
    with open(path, "wb") as f:
        sep = b"\n" if suffix == ".jsonl" else b",\n"
        f.write(b"" if suffix == ".jsonl" else b"[")
        f.write(_conv(0) + sep)
        _giant(f, 40)  # 40 MB, 20x MAX_RECORD_BYTES
        f.write(sep + _conv(1) + (b"\n" if suffix == ".jsonl" else b"]"))
    convs, skips, peak = _collect_peak(path)
    assert [c.messages[0]["content"] for c in convs] == ["q0", "q1"]
    assert skips == {"too_large": 1}
    assert peak < 5 * MAX_RECORD_BYTES, f"peak {peak / 1e6:.1f} MB"


def test_a_package_sources_object_is_streamed_value_by_value(tmp_path):
    path = tmp_path / "chats.json"
    big = b"[" + b", ".join([b'{"sender": "a", "text": "' + b"y" * (MAX_RECORD_BYTES + 10) + b'"}']) + b"]"
    chat = {"messages": [[{"sender": "a", "text": "hi"}], [{"sender": "b", "text": "hello"}]]}
    path.write_bytes(
        b'{"c1": '
        + json.dumps(chat).encode()
        + b', "c2": {"messages": ['
        + big
        + b"]}, "
        + b'"c3": '
        + json.dumps(chat).encode()
        + b"}"
    )
    skips: Counter = Counter()
    records = list(iter_chitchat(path, skips))
    assert records == [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 2
    assert skips == {"too_large": 1}


def _listening(pid: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* shows them) of the TCP sockets that `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    rows = [line.split() for f in ("/proc/net/tcp", "/proc/net/tcp6") for line in open(f).readlines()[1:]]
    return [r[1] for r in rows if r[3] == "0A" and r[9] in inodes]


LOOPBACK = ("0100007F:", "00000000000000000000000001000000:", "0000000000000000FFFF00000100007F:")


@pytest.mark.slow  # 5 s alone, up to 60 s when DeepSpeed rebuilds its CPU op on a loaded machine
def test_a_process_without_launcher_listens_on_loopback_only(tmp_path):
    code = (
        "import sys, time; from eagle3ft.config import load_config; from eagle3ft.train.dist import Dist; "
        "d = Dist(load_config(sys.argv[1]).train); print('ready', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(TINY)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert "ready" in iter(lambda: p.stdout.readline().strip() or "EOF", "EOF")  # after DeepSpeed's banner
        bound = _listening(p.pid)
    finally:
        p.kill()
        p.wait()
    assert all(addr.startswith(LOOPBACK) for addr in bound), bound


def test_ranks_of_one_machine_bind_loopback_and_several_machines_keep_their_interface(monkeypatch):
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    loopback_only()
    assert "GLOO_SOCKET_IFNAME" not in os.environ and "NCCL_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the user's own setting wins
    loopback_only()
    assert os.environ["GLOO_SOCKET_IFNAME"].startswith("lo") and os.environ["NCCL_SOCKET_IFNAME"] == "ib0"


def _left_running(run: Path) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(run).encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            pass
    return pids


def _error_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (r.stdout + r.stderr).splitlines() if re.search("error|traceback", line, re.I)]


@pytest.mark.slow
def test_an_input_error_of_a_two_process_launch_is_one_line_and_its_traceback_is_in_the_log(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = launch(empty, timeout=300)
    assert r.returncode != 0
    assert _error_lines(r) == [f"finetune: error: no feature store at {empty}/features (missing manifest.json)"]
    log = (empty / "logs" / "train-error.log").read_text()
    assert log.startswith("Traceback") and "StoreError" in log
    busy = tmp_path / "busy"
    write_store(busy)
    owner = subprocess.Popen(["sleep", "120"])
    try:
        lock = {"host": socket.gethostname(), "pid": owner.pid, "stage": "harvest", "started": "now"}
        (busy / ".lock").write_text(json.dumps(lock))
        r = launch(busy, timeout=300)  # rank 0 alone meets this error; rank 1 goes on until rank 0 ends it
    finally:
        owner.kill()
        owner.wait()
    assert r.returncode != 0
    assert [line.split(" (pid")[0] for line in _error_lines(r)] == [f"finetune: error: {busy} is in use by harvest"]
    time.sleep(0.5)
    assert _left_running(busy) == []


def test_a_stale_extension_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch, capsys):
    """A DeepSpeed CPU-op build killed mid-way leaves its lock, and every later launch waits on it forever."""
    import os
    import time

    from eagle3ft.train.launcher import STALE_LOCK_S, clear_stale_build_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, fresh = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", tmp_path / "py311_cpu" / "other" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    assert clear_stale_build_locks() == [stale]
    assert not stale.exists() and fresh.exists()
    assert "left by a build killed mid-way" in capsys.readouterr().err
