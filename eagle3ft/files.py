"""Reading the files stages hand each other, with an error that names the file when one is damaged."""

from __future__ import annotations

import json
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


def safetensors_keys(path: str | Path, what: str) -> list[str]:
    """The tensor names of a safetensors file; DamagedFile naming the file when its header or length is wrong."""
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except SafetensorError as e:
        raise DamagedFile(
            f"{path}: {what} is not a readable safetensors file ({e}); the file is truncated or damaged"
        ) from None
