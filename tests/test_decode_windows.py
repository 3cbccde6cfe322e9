"""benchmarks/decode_windows.py: the servers' decode lines summed per window, from real SGLang 0.5.17 log lines."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("decode_windows", ROOT / "benchmarks/decode_windows.py")
decode_windows = sys.modules["decode_windows"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(decode_windows)

LINE = (
    "[2026-12-01 03:26:{s:02d}] Decode batch, #running-req: {run}, #token: {tok}, token usage: 0.01, cuda graph: True, "
    "gen throughput (token/s): {rate:.2f}, #queue-req: 0"
)


def write_log(path: Path, lines: list[tuple[int, int, int, float]]) -> Path:
    other = '[2026-12-01 03:26:00] INFO:     127.0.0.1:33200 - "POST /generate HTTP/1.1" 200 OK'
    path.write_text("\n".join([other] + [LINE.format(s=s, run=r, tok=t, rate=g) for s, r, t, g in lines]) + "\n")
    return path


def test_windows_sum_the_servers_mean_rates_and_keep_the_work_per_server(tmp_path, capsys):
    a = write_log(
        tmp_path / "server0.log", [(1, 100, 50_000, 10_000.0), (5, 100, 60_000, 20_000.0), (12, 50, 50_000, 4_000.0)]
    )
    b = write_log(tmp_path / "server1.log", [(3, 200, 40_000, 30_000.0)])
    rows = decode_windows.windows([decode_windows.decode_lines(a), decode_windows.decode_lines(b)], 10.0)
    assert [r["servers"] for r in rows] == [2, 1]
    assert rows[0]["tok_s"] == pytest.approx(15_000.0 + 30_000.0)  # server 0's mean in the window, plus server 1's
    assert rows[0]["running"] == [100, 200] and rows[0]["context_per_request"] == [550, 200]
    assert rows[1]["tok_s"] == pytest.approx(4_000.0) and rows[1]["running"] == [50, 0]

    decode_windows.main([str(a), str(b), "--json", str(tmp_path / "w.json"), "--plot", str(tmp_path / "w.png")])
    assert json.loads((tmp_path / "w.json").read_text()) == rows
    assert (tmp_path / "w.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "45.0 k tok/s" in out
    assert f"{a}: gen throughput median 10,000 tok/s, p90 10,000, 3 lines" in out  # each server's own rate first

    quiet = write_log(tmp_path / "server2.log", [])  # a server that decoded nothing is left out, and said so
    decode_windows.main([str(a), str(b), str(quiet)])
    assert f"{quiet}: no decode lines (left out)" in capsys.readouterr().out


def test_a_log_without_decode_lines_is_named(tmp_path):
    empty = tmp_path / "server9.log"
    empty.write_text("[2026-12-01 03:26:00] The server is fired up and ready to roll!\n")
    with pytest.raises(SystemExit, match="server9.log"):
        decode_windows.main([str(empty)])


def test_prefill_lines_give_the_prompt_tokens_computed_and_cached(tmp_path, capsys):
    prefill = (
        "[2026-12-01 03:26:{s:02d}] Prefill batch, #new-seq: 8, #new-token: {new}, #cached-token: {hit}, "
        "token usage: 0.01, #running-req: 300, #queue-req: 40, #pending-token: 0, cuda graph: False, "
        "input throughput (token/s): 90000.00"
    )
    log = write_log(tmp_path / "server0.log", [(1, 100, 50_000, 10_000.0)])
    log.write_text(
        log.read_text() + prefill.format(s=2, new=1200, hit=3000) + "\n" + prefill.format(s=3, new=800, hit=0)
    )
    assert decode_windows.prefill_tokens(log) == (2000, 3000)
    decode_windows.main([str(log)])
    assert "2,000 prompt tokens computed, 3,000 from the prefix cache (60%)" in capsys.readouterr().out
