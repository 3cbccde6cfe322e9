"""Bounded readers of prompt files: records come out one at a time, and a line or record over `max_bytes` is
skipped and counted (`too_large`) without ever being held whole, so memory stays bounded whatever the input.

- JSON lines (``.jsonl``, gzipped or not): read with ``readline(max_bytes + 1)``; the rest of a longer line is read
  past in chunks. Blank lines count as ``blank_line``, undecodable ones as ``invalid_utf8``, bad JSON as
  ``malformed``.
- A top-level JSON array, or object (its values are the records), e.g. ShareGPT's (truncated at the end) or
  chit-chat's: streamed item by item; an item longer than `max_bytes` (counted in decoded characters) is scanned past
  by its brackets and strings. A ``.json`` file that does not open with ``[`` is read as JSON lines, as `datasets`
  would.
- Parquet: row by row through pyarrow in small batches (memory: one row group); a row whose JSON form is longer than
  `max_bytes` is skipped.
"""

from __future__ import annotations

import codecs
import json
import re
from collections import Counter
from pathlib import Path
from typing import BinaryIO, Iterator

MAX_RECORD_BYTES = 2 << 20  # ShareGPT's longest conversation is 0.44 MB; a prompt this long would not fit a target
_STRING_BODY = re.compile(r'[^"\\]*+(?:\\.[^"\\]*+)*+', re.S)  # a string's characters up to its closing quote
_NOT_STRUCTURAL = re.compile(r'[^"\[\]{}]*')
_SCALAR_END = re.compile(r"[,\]}\s]")


class _Skipper:
    """Scans past one JSON value across chunks without keeping it: bracket depth, inside a string or not."""

    def __init__(self, first: str) -> None:
        self.scalar = first not in '"[{'
        self.depth, self.in_string, self.escape = 0, False, False

    def feed(self, buf: str, pos: int) -> int | None:
        """The position just past the value's end in `buf`, or None when `buf` ends first."""
        if self.scalar:
            m = _SCALAR_END.search(buf, pos)
            return m.start() if m else None
        while pos < len(buf):
            if self.escape:
                self.escape, pos = False, pos + 1
            elif self.in_string:
                pos = _STRING_BODY.match(buf, pos).end()
                if pos == len(buf):
                    return None
                if buf[pos] == "\\":  # an escape cut by the chunk's end
                    self.escape, pos = True, pos + 1
                    continue
                self.in_string, pos = False, pos + 1
            else:
                pos = _NOT_STRUCTURAL.match(buf, pos).end()
                if pos == len(buf):
                    return None
                c, pos = buf[pos], pos + 1
                if c == '"':
                    self.in_string = True
                    continue
                self.depth += 1 if c in "[{" else -1
            if self.depth == 0 and not self.in_string:
                return pos
        return None


def iter_json_items(
    f: BinaryIO, skips: Counter, max_bytes: int = MAX_RECORD_BYTES, chunk_bytes: int = 1 << 20
) -> Iterator[object]:
    """Items of a (possibly truncated) top-level JSON array, or the values of a top-level object, in binary file
    `f`, read only as far as consumed. Undecodable bytes become lone surrogates, which normalize() skips as
    invalid_utf8."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    buf, pos, eof, container, index, skipper = "", 0, False, "", 0, None
    while True:
        if skipper is not None:
            end = skipper.feed(buf, pos)
            pos, skipper = (len(buf), skipper) if end is None else (end, None)
        while skipper is None and pos < len(buf):
            c = buf[pos]
            if not container and c in "[{":
                container = c
            elif not (c.isspace() or c == "," or (c == ":" and container == "{")):
                break
            pos += 1
        if skipper is None and pos < len(buf) and buf[pos] in "]}":
            return
        if skipper is None and pos < len(buf):
            try:
                start = pos
                item, pos = decoder.raw_decode(buf, pos)
                index += 1
                if container == "{" and index % 2:  # an object's keys are every other item
                    continue
                if pos - start > max_bytes:
                    skips["too_large"] += 1
                else:
                    yield item
                continue
            except json.JSONDecodeError:
                if eof:
                    skips["truncated_tail"] += 1
                    return
                if len(buf) - pos > max_bytes:
                    skips["too_large"] += 1 if container == "[" or index % 2 == 1 else 0
                    index += 1
                    skipper = _Skipper(buf[pos])
                    continue
        elif skipper is None and eof:
            return
        elif skipper is not None and eof:
            skips["truncated_tail"] += 1
            return
        data = f.read(chunk_bytes)
        eof = not data
        buf = buf[pos:] + utf8.decode(data, final=eof)
        pos = 0


def iter_lines(f: BinaryIO, skips: Counter, max_bytes: int = MAX_RECORD_BYTES) -> Iterator[bytes]:
    """The lines of binary file `f` (newline kept off), each at most `max_bytes`; a longer one is read past in
    chunks and counted as too_large."""
    while True:
        line = f.readline(max_bytes + 1)
        if not line:
            return
        if len(line) > max_bytes and not line.endswith(b"\n"):
            skips["too_large"] += 1
            while line and not line.endswith(b"\n"):
                line = f.readline(1 << 20)
            continue
        yield line.rstrip(b"\r\n")


def iter_jsonl_file(f: BinaryIO, skips: Counter, max_bytes: int = MAX_RECORD_BYTES) -> Iterator[object]:
    for line in iter_lines(f, skips, max_bytes):
        if not line.strip():
            skips["blank_line"] += 1
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            skips["invalid_utf8"] += 1
            continue
        try:
            yield json.loads(text)
        except json.JSONDecodeError:
            skips["malformed"] += 1


def iter_jsonl(path: Path, skips: Counter, max_bytes: int = MAX_RECORD_BYTES) -> Iterator[object]:
    with open(path, "rb") as f:
        yield from iter_jsonl_file(f, skips, max_bytes)


def iter_json(path: Path, skips: Counter, max_bytes: int = MAX_RECORD_BYTES) -> Iterator[object]:
    """A .json file: a top-level array streamed item by item, else JSON lines (as `datasets` reads one)."""
    with open(path, "rb") as f:
        array = f.read(64).lstrip()[:1] == b"["
        f.seek(0)
        yield from (iter_json_items if array else iter_jsonl_file)(f, skips, max_bytes)


def iter_parquet(path: Path, skips: Counter, max_bytes: int = MAX_RECORD_BYTES) -> Iterator[object]:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=64):
        for row in batch.to_pylist():
            if len(json.dumps(row, ensure_ascii=False, default=str)) > max_bytes:
                skips["too_large"] += 1
                continue
            yield row
