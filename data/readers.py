"""Bounded readers of prompt files: records come out one at a time, and a line or record over `max_bytes` is
skipped and counted (`too_large`) without ever being held whole, so memory stays bounded whatever the input. A record
nested deeper than MAX_DEPTH is skipped as `too_deep` (json's decoder recurses: 200,000 brackets in a line would
raise RecursionError), a number json cannot convert as `malformed`. No single record stops a reader. With a `Skips`
(a Counter that also keeps where), each skip is counted with its file and line.

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
MAX_DEPTH = 32  # nesting of one record: a conversation needs 4 (record, list of turns, turn, text)
_STRING_BODY = re.compile(r'[^"\\]*+(?:\\.[^"\\]*+)*+', re.S)  # a string's characters up to its closing quote
_NOT_STRUCTURAL = re.compile(r'[^"\[\]{}]*')
_SCALAR_END = re.compile(r"[,\]}\s]")


class Skips(Counter):
    """Skipped records by reason (a Counter), and where the first SHOWN of each reason are (`at`: reason ->
    ["file:line", ...]); `where` is the record being read, which the readers set before they yield it."""

    SHOWN = 5

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.at: dict[str, list[str]] = {}
        self.where: str | None = None

    def add(self, reason: str, where: str | None = None) -> None:
        self[reason] += 1
        shown = self.at.setdefault(reason, [])
        if (where or self.where) and len(shown) < self.SHOWN:
            shown.append(where or self.where)


def skip(skips: Counter, reason: str, where: str | None = None) -> None:
    """Count one skipped record under `reason`; a Skips also keeps `where` (default: the record being read)."""
    if isinstance(skips, Skips):
        skips.add(reason, where)
    else:
        skips[reason] += 1


def reading(skips: Counter, where: str) -> None:
    """Tell a Skips which record comes next (its file and line), for the checks made after a reader yields it."""
    if isinstance(skips, Skips):
        skips.where = where


def depth(value: object) -> int:
    """How deeply `value` nests lists and dicts (a scalar is 0), walked without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            deepest = max(deepest, d)
            todo += [(c, d + 1) for c in children if isinstance(c, (list, dict))]
    return deepest


def loads(text: str) -> tuple[object, str | None]:
    """(the JSON value, None) or (None, why it is skipped): malformed, too_deep."""
    try:
        value = json.loads(text)
    except RecursionError:
        return None, "too_deep"
    except ValueError:  # not JSON, or an integer longer than Python converts
        return None, "malformed"
    return (value, None) if depth(value) <= MAX_DEPTH else (None, "too_deep")


def _name(f: BinaryIO) -> str:
    return str(getattr(f, "name", "<stream>"))


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
    name, line, counted = _name(f), 1, 0  # the line number at buf[counted]

    def at(p: int) -> str:
        """file:line of buf[p] (p never moves back within a buffer)."""
        nonlocal line, counted
        line, counted = line + buf.count("\n", counted, p), p
        return f"{name}:{line}"

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
            record = container == "[" or index % 2 == 1  # an object's keys are every other item
            where = at(pos)
            try:
                start = pos
                item, pos = decoder.raw_decode(buf, pos)
                index += 1
                if not record:
                    continue
                if pos - start > max_bytes:
                    skip(skips, "too_large", where)
                elif depth(item) > MAX_DEPTH:
                    skip(skips, "too_deep", where)
                else:
                    reading(skips, where)
                    yield item
                continue
            except json.JSONDecodeError:
                if eof:
                    skip(skips, "truncated_tail", where)
                    return
                if len(buf) - pos > max_bytes:
                    if record:
                        skip(skips, "too_large", where)
                    index += 1
                    skipper = _Skipper(buf[pos])
                    continue
            except (RecursionError, ValueError) as e:  # nested past the decoder's recursion, or a number too long
                if record:
                    skip(skips, "too_deep" if isinstance(e, RecursionError) else "malformed", where)
                index += 1
                skipper = _Skipper(buf[pos])
                continue
        elif skipper is None and eof:
            return
        elif skipper is not None and eof:
            skip(skips, "truncated_tail")
            return
        data = f.read(chunk_bytes)
        eof = not data
        at(pos)
        buf, counted = buf[pos:] + utf8.decode(data, final=eof), 0
        pos = 0


def iter_lines(f: BinaryIO, skips: Counter, max_bytes: int = MAX_RECORD_BYTES) -> Iterator[bytes]:
    """The lines of binary file `f` (newline kept off), each at most `max_bytes`; a longer one is read past in
    chunks and counted as too_large. A Skips is told each line's file:line before it is yielded."""
    name, number = _name(f), 0
    while True:
        line = f.readline(max_bytes + 1)
        number += 1
        if not line:
            return
        if len(line) > max_bytes and not line.endswith(b"\n"):
            skip(skips, "too_large", f"{name}:{number}")
            while line and not line.endswith(b"\n"):
                line = f.readline(1 << 20)
            continue
        reading(skips, f"{name}:{number}")
        yield line.rstrip(b"\r\n")


def iter_jsonl_file(f: BinaryIO, skips: Counter, max_bytes: int = MAX_RECORD_BYTES) -> Iterator[object]:
    for line in iter_lines(f, skips, max_bytes):
        if not line.strip():
            skip(skips, "blank_line")
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            skip(skips, "invalid_utf8")
            continue
        value, why = loads(text)
        if why:
            skip(skips, why)
            continue
        yield value


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

    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=64):
        for row in batch.to_pylist():
            number += 1
            where = f"{path}:row {number}"
            if depth(row) > MAX_DEPTH:
                skip(skips, "too_deep", where)
            elif len(json.dumps(row, ensure_ascii=False, default=str)) > max_bytes:
                skip(skips, "too_large", where)
            else:
                reading(skips, where)
                yield row
