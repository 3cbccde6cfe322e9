"""What a GPU's SGLang servers decoded together over time: their `Decode batch` log lines summed in windows.

Each server logs its own rate ("gen throughput (token/s)") with its running requests and the tokens they hold. Per
window of `--window` seconds this takes each server's mean rate and sums them over the servers: the GPU's decode
rate, which the servers' medians alone do not give when several share a GPU. It also prints the running requests and
tokens of context per request, so that a fall in rate can be told apart from a fall in work (the multi-turn tail).

    python benchmarks/decode_windows.py results/ttt3-10m-shipped/server*.decode-lines.txt --plot decode.png

Files: SGLang server logs, or the `Decode batch` lines of them. It first prints each server's median and p90 rate
(what benchmarks/leases/phases/servers.sh's `gen_throughput` reports after a regeneration), and, from its `Prefill
batch` lines where the log has them, the prompt tokens it prefilled and those its prefix cache held.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from datetime import datetime
from pathlib import Path

LINE = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] Decode batch, #running-req: (\d+), #token: (\d+),"
    r".*?gen throughput \(token/s\): ([0-9.]+)"
)

PREFILL = re.compile(r"Prefill batch.*?#new-token: (\d+), #cached-token: (\d+)")


def prefill_tokens(path: Path) -> tuple[int, int]:
    """(prompt tokens prefilled, prompt tokens found in the prefix cache) over one server's `Prefill batch` lines."""
    new = cached = 0
    for m in PREFILL.finditer(path.read_text(errors="replace")):
        new, cached = new + int(m.group(1)), cached + int(m.group(2))
    return new, cached


def decode_lines(path: Path) -> list[tuple[float, int, int, float]]:
    """(unix seconds, running requests, tokens held, decode tok/s) per `Decode batch` line of one server's log."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = LINE.search(line)
        if m:
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            out.append((t, int(m.group(2)), int(m.group(3)), float(m.group(4))))
    return out


def windows(servers: list[list[tuple[float, int, int, float]]], width: float) -> list[dict]:
    """Per window that any server logged in: the summed mean rate, and per server the mean running requests and
    tokens of context per request."""
    by: dict[int, dict[int, list]] = {}
    for k, lines in enumerate(servers):
        for t, run, tok, rate in lines:
            by.setdefault(int(t // width), {}).setdefault(k, []).append((run, tok, rate))
    rows = []
    for w in sorted(by):
        per = by[w]
        rows.append(
            {
                "start": w * width,
                "servers": len(per),
                "tok_s": sum(statistics.mean(r for _, _, r in v) for v in per.values()),
                "running": [
                    round(statistics.mean(n for n, _, _ in per[k])) if k in per else 0 for k in range(len(servers))
                ],
                "context_per_request": [
                    round(statistics.mean(tok / max(n, 1) for n, tok, _ in per[k])) if k in per else 0
                    for k in range(len(servers))
                ],
            }
        )
    return rows


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = rows[0]["start"]
    t = [(r["start"] - t0) for r in rows]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    a.step(t, [r["tok_s"] / 1e3 for r in rows], where="post")
    a.set_ylabel("decode, all servers (k tok/s)")
    a.grid(alpha=0.3)
    b.step(t, [sum(r["running"]) for r in rows], where="post", label="running requests")
    b.set_ylabel("running requests, all servers")
    c = b.twinx()
    c.plot(t, [statistics.mean(r["context_per_request"]) for r in rows], color="tab:orange", label="tokens per request")
    c.set_ylabel("context tokens per request", color="tab:orange")
    b.set_xlabel("seconds since the first decode line")
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", type=Path, help="one SGLang server log (or its decode lines) per server")
    p.add_argument("--window", type=float, default=10.0, help="seconds per window (10)")
    p.add_argument("--plot", type=Path, help="write the rate and the work over time to this PNG")
    p.add_argument("--json", type=Path, help="write the windows to this JSON file")
    args = p.parse_args(argv)
    found = {f: decode_lines(f) for f in args.logs}
    if not any(found.values()):
        raise SystemExit(f"no 'Decode batch' lines with a gen throughput in {', '.join(map(str, args.logs))}")
    for f, lines in found.items():  # each server's own rate, over its lines that decoded anything
        rates = sorted(r for *_, r in lines if r > 0)
        if not rates:
            print(f"{f}: no decode lines (left out)")
            continue
        p90 = rates[int(0.9 * (len(rates) - 1))]
        print(f"{f}: gen throughput median {statistics.median(rates):,.0f} tok/s, p90 {p90:,.0f}, {len(rates)} lines")
        new, cached = prefill_tokens(f)
        if new + cached:
            print(
                f"  prefill: {new:,} prompt tokens computed, {cached:,} from the prefix cache ({cached / (new + cached):.0%})"
            )
    servers = [lines for lines in found.values() if lines]
    rows = windows(servers, args.window)
    t0 = rows[0]["start"]
    for r in rows:
        print(
            f"+{r['start'] - t0:6.0f} s  {r['tok_s'] / 1e3:6.1f} k tok/s  running {r['running']}  "
            f"tokens/request {r['context_per_request']}"
        )
    full = [r["tok_s"] for r in rows if r["servers"] == len(servers)]
    print(f"{len(rows)} windows of {args.window:g} s; all {len(servers)} servers logging in {len(full)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
