"""The prompt files a GPU lease carries, made from the installed packages (the GPU machine has none of them).

    python benchmarks/leases/carry_data.py OUT

writes what benchmarks/leases/run_phases.sh's `setup` expects under $C:
  OUT/b/data/sharegpt-prompts.json.gz  every ShareGPT conversation, its split parts joined, as the system message and
                                       user turns that regeneration keeps (a tenth of the package's 120 MB)
  OUT/b/data/mtbench-questions.jsonl   the 80 MT-Bench questions
  OUT/b/data/HumanEval.jsonl.gz        the 164 HumanEval problems
  OUT/d/chitchat.json.gz               chitchat-dataset's conversations
and checks that the ShareGPT file gives regeneration the very conversations, in the same order, that the package does.

    python benchmarks/leases/carry_data.py --jsonl OUT

writes only what benchmarks/leases/live_speedup.sh and k2_rehearsal.sh carry: OUT/sharegpt-first-turns.jsonl (the first
2,000 conversations' first user turns) and OUT/sharegpt-conversations.jsonl (every conversation's user turns).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from eagle3ft.config import SourceConfig
from eagle3ft.data.prompts import (
    Skip,
    chitchat_path,
    collect,
    humaneval_path,
    iter_records,
    mtbench_path,
    normalize,
)


def regen_view(max_turns: int = 1_000_000) -> list[dict]:
    """ShareGPT's records as regeneration reads them: parts joined, then the system message and user turns."""
    out = []
    for r in iter_records(SourceConfig(kind="sharegpt"), Counter()):
        try:
            msgs = normalize(r, max_turns, regenerate=True)
        except Skip:
            continue
        out.append({"id": r.get("id"), "conversations": [{"from": m["role"], "value": m["content"]} for m in msgs]})
    return out


def keys(src: SourceConfig) -> list[str]:
    convs = collect([src], max_turns=1000, regenerate=True, heldout_fraction=0.0, dedupe=True, skips=Counter())
    return [c.key for c in convs]


def write_jsonl(out: Path, first_turns: int = 2000) -> None:
    """The live bench's prompt files, one {"id", "messages"} per line: the first turns, then every conversation."""
    out.mkdir(parents=True, exist_ok=True)
    for name, max_turns, limit in (("first-turns", 1, first_turns), ("conversations", 1000, None)):
        with (out / f"sharegpt-{name}.jsonl").open("w") as f:
            n = 0
            for k, rec in enumerate(iter_records(SourceConfig(kind="sharegpt"), Counter())):
                try:
                    msgs = normalize(rec, max_turns, regenerate=True)
                except Skip:
                    continue
                if limit is None and any(m["role"] == "user" for m in msgs):
                    f.write(json.dumps({"id": f"sharegpt-{k}", "messages": msgs}) + "\n")
                elif limit is not None and msgs and msgs[0]["role"] == "user":
                    f.write(json.dumps({"id": f"sharegpt-{k}", "messages": msgs[:1]}) + "\n")
                    n += 1
                    if n >= limit:
                        break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--jsonl", action="store_true", help="only the live bench's two ShareGPT jsonl files")
    args = ap.parse_args()
    out = args.out
    if args.jsonl:
        write_jsonl(out)
        return
    data, d = out / "b" / "data", out / "d"
    data.mkdir(parents=True, exist_ok=True)
    d.mkdir(parents=True, exist_ok=True)
    records = regen_view()
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "sharegpt-prompts.json"
        plain.write_text(json.dumps(records, ensure_ascii=False))
        ours, theirs = keys(SourceConfig(kind="sharegpt", path=str(plain))), keys(SourceConfig(kind="sharegpt"))
        if ours != theirs:
            raise SystemExit(
                f"the prompt file gives {len(ours)} conversations, the package {len(theirs)}: not the same"
            )
        with plain.open("rb") as f, gzip.open(data / "sharegpt-prompts.json.gz", "wb") as g:
            shutil.copyfileobj(f, g)
    shutil.copyfile(mtbench_path(), data / "mtbench-questions.jsonl")
    he = humaneval_path()
    if he.name.endswith(".gz"):
        shutil.copyfile(he, data / "HumanEval.jsonl.gz")
    else:
        with he.open("rb") as f, gzip.open(data / "HumanEval.jsonl.gz", "wb") as g:
            shutil.copyfileobj(f, g)
    with chitchat_path().open("rb") as f, gzip.open(d / "chitchat.json.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    print(f"{len(ours)} ShareGPT conversations ({len(records)} records); files:")
    for p in sorted(out.rglob("*")):
        if p.is_file():
            print(f"  {p} {p.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
