"""Reading the files stages hand each other, with an error that names the file when one is damaged, and writing
them atomically without following a link; a full disk is one error naming the file and its file system (`DiskFull`),
with nothing half written left behind."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError, safe_open


class DamagedFile(ValueError):
    """A file that is there but cannot be read as what it should be (truncated, not JSON, not safetensors)."""


def read_json(path: str | Path, what: str):
    """The JSON in `path`; DamagedFile naming the file when it is not valid JSON."""
    try:
        return json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DamagedFile(f"{path}: {what} is not valid JSON ({e}); the file is truncated or damaged") from None


def read_json_object(path: str | Path, what: str) -> dict:
    """The JSON object in `path` (a config.json): FileNotFoundError when there is no such file, DamagedFile when it is
    not valid JSON, ValueError when it holds something else than an object; each names `what` and the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} not found: {p}")
    raw = read_json(p, f"the {what}")
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: the {what} is not a JSON object")
    return raw


def safetensors_keys(path: str | Path, what: str) -> list[str]:
    """The tensor names of a safetensors file; DamagedFile naming the file when its header or length is wrong."""
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except SafetensorError as e:
        raise DamagedFile(
            f"{path}: {what} is not a readable safetensors file ({e}); the file is truncated or damaged"
        ) from None


class NonFinite(ValueError):
    """A tensor holding NaN or inf where only finite values may be: the message names the file or folder and the
    tensor."""


def check_finite(tensors, where: str) -> None:
    """NonFinite naming `where` and the first tensor of `tensors` ({name: tensor} or (name, tensor) pairs) that holds
    a NaN or inf."""
    import torch

    for name, t in tensors.items() if isinstance(tensors, dict) else tensors:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = t.numel() - int(torch.isfinite(t).sum())
            raise NonFinite(f"{where}: tensor {name} holds {bad} non-finite value(s) (NaN or inf)")


def check_finite_file(path: str | Path, what: str) -> None:
    """check_finite over every tensor of a safetensors file, read one tensor at a time (`what` opens the message);
    DamagedFile when it cannot be read."""
    keys = safetensors_keys(path, what)
    with safe_open(path, framework="pt") as f:
        check_finite(((k, f.get_tensor(k)) for k in keys), f"{what} {path}")


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file, read 4 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _nonfinite_at(obj, at: str = "") -> str | None:
    """The key path (a.b[2]) of the first NaN or infinite float in plain data, or None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return at or "the value"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        found = _nonfinite_at(v, f"{at}[{k}]" if isinstance(k, int) else f"{at}.{k}" if at else str(k))
        if found:
            return found
    return None


def json_text(obj, where: str, **kw) -> str:
    """`obj` as strict JSON: RFC 8259 has no NaN or Infinity, which json.dumps writes by default and strict readers
    refuse. A non-finite float is a ValueError naming `where` and its key, and nothing is written."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:
        key = _nonfinite_at(obj)
        if key is None:
            raise
        raise ValueError(
            f"{where}: {key} is not a finite number; strict JSON has no NaN or Infinity: not written"
        ) from None


def write_json(path: str | Path, obj, indent: int | None = 1, newline: bool = False) -> None:
    """`obj` as strict JSON (json_text) into `path`, atomically (write_atomic)."""
    write_atomic(path, json_text(obj, str(path), indent=indent) + ("\n" if newline else ""))


FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left on the device; the user's disk quota is used up


class DiskFull(OSError):
    """A write that found no space left: the message names the file, its file system and the space free there."""


def _mount(path: Path) -> Path:
    """The mount point of the file system that holds `path` (its nearest existing folder)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def disk_full_error(path: str | Path, error: OSError | None = None) -> DiskFull:
    """DiskFull for a write to `path` that found the disk (or the quota) full."""
    mount = _mount(Path(path))
    free = shutil.disk_usage(mount).free
    why = "the disk quota is used up" if error is not None and error.errno == errno.EDQUOT else "no space left"
    return DiskFull(
        f"{path}: {why} on the file system at {mount} ({free / 2**30:.1f} GiB free): free space there (or give "
        "--run-dir a disk with room) and rerun; what was committed before is kept, this write was not",
    )


@contextmanager
def disk_full(path: str | Path):
    """Writes to `path` inside: a full disk (ENOSPC, EDQUOT) becomes DiskFull naming it."""
    try:
        yield
    except DiskFull:
        raise
    except OSError as e:
        if e.errno not in FULL:
            raise
        raise disk_full_error(path, e) from None
    except SafetensorError as e:  # safetensors puts the OS error in its message, only there (no errno)
        code = os_error_code(str(e))
        if code not in FULL:
            raise
        raise disk_full_error(path, OSError(code, str(e))) from None


def os_error_code(message: str) -> int | None:
    """The OS error number in a safetensors error message: 0.8's "I/O error: No space left on device (os error 28)",
    or the older "IoError(Os { code: 28, kind: StorageFull, ... })"."""
    code = re.search(r"\(os error (\d+)\)|\bcode: (\d+)", message)
    return int(code[1] or code[2]) if code else None


def as_umask_allows(path: str | Path) -> None:
    """Give `path` the mode a plain open() gives a new file (0666 less the umask): safetensors 0.8 writes through a
    temporary file of mode 0600 and renames it, so its weights would be unreadable by a group that reads the
    config.json beside them."""
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_atomic(path: str | Path, data: bytes | str, tmp_name: str | None = None) -> None:
    """Write `data` to `path` whole or not at all: a temporary file beside it (`.NAME.tmp`, or `tmp_name`), fsync,
    os.replace, fsync of the folder.

    The temporary name is created fresh (O_EXCL | O_NOFOLLOW) after removing whatever is there, a killed writer's
    leftover or a planted link, so no write goes through a link; os.replace then replaces a link at `path` itself
    rather than the file it points to.
    """
    path = Path(path)
    tmp = path.with_name(tmp_name or f".{path.name}.tmp")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with disk_full(path), os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:  # a full disk, a kill: no half-written file is left beside it
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
