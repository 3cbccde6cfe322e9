"""Regeneration throughput through running SGLang servers, per concurrency setting.

    python benchmarks/regen_speed.py --config configs/smollm2-135m.yaml --url http://127.0.0.1:30000 \
        [--url ...] --conversations 2000 --settings 64x8,128x8,256x4 --out runs/regen-speed

Each setting ``CxB`` (C requests in flight per server, B prompts per /generate call; ``CxB:fifo`` sends turns
first come first served instead of by priority, ``harvest.sglang.priority``) regenerates the same first
``--conversations`` ShareGPT conversations with data/regen.py into its own run folder, from scratch, after
flushing each server's prefix cache. Prints one line per setting and writes
``OUT/regen_speed.json`` (every setting's summary). ``--set`` passes further config overrides.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import requests

from eagle3ft.config import load_config
from eagle3ft.data.regen import run_regen as regen


def parse_settings(text: str) -> list[tuple[int, int, bool]]:
    """'128x8,1024x1:fifo' -> [(128, 8, True), (1024, 1, False)]: (in flight per server, prompts per call, priority)."""
    out = []
    for part in text.split(","):
        size, _, order = part.strip().partition(":")
        c, _, b = size.partition("x")
        if not c.isdigit() or not b.isdigit() or order not in ("", "priority", "fifo"):
            raise SystemExit(
                f"--settings: {part!r} is not CxB[:fifo|:priority] (requests in flight per server x prompts per request)"
            )
        out.append((int(c), int(b), order != "fifo"))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--url", action="append", required=True, help="a running SGLang server, repeatable")
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--max-turns", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--settings", default="64x8,128x8,256x4,256x8")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", default="runs/regen-speed")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for c, b, priority in parse_settings(args.settings):
        sets = [
            f"harvest.sources=[{{kind: sharegpt, limit: {args.conversations}}}]",
            "harvest.backend=sglang",
            f"harvest.sglang.urls=[{', '.join(args.url)}]",
            f"harvest.sglang.concurrency={c}",
            f"harvest.sglang.prompts_per_request={b}",
            f"harvest.sglang.priority={str(priority).lower()}",
            f"harvest.max_turns={args.max_turns}",
            f"harvest.max_new_tokens={args.max_new_tokens}",
            f"harvest.max_total_tokens={max(4096, 2 * args.max_new_tokens)}",
            "harvest.max_prompt_tokens=2048",
            "harvest.heldout_fraction=0.0",
            *args.overrides,
        ]
        cfg = load_config(args.config, sets)
        run = out / f"c{c}-b{b}{'' if priority else '-fifo'}"
        shutil.rmtree(run, ignore_errors=True)
        for u in args.url:
            requests.post(u.rstrip("/") + "/flush_cache", timeout=60)
        s = regen(cfg, run)
        row = {
            "servers": len(args.url),
            "in_flight_per_server": c,
            "prompts_per_request": b,
            "priority": priority,
            "prompts_in_flight": c * b * len(args.url),
            **{k: s[k] for k in ("answer_tokens", "answers", "unfinished_answers", "wall_s", "answer_tokens_per_s")},
        }
        results.append({**row, "summary": s})
        print(json.dumps(row), flush=True)
    (out / "regen_speed.json").write_text(json.dumps(results, indent=1))
    best = max(results, key=lambda r: r["answer_tokens_per_s"])
    print(
        f"best: {best['answer_tokens_per_s']:,.0f} answer tokens/s at {best['in_flight_per_server']} requests x "
        f"{best['prompts_per_request']} prompts per server ({best['servers']} server(s))",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
