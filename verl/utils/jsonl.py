"""Reading verl's own append-only JSON Lines files (metrics.jsonl, samples.jsonl, ...).

A crash in the middle of a write leaves a partial last line. Every reader goes through `read_jsonl`, which
drops such a line with one warning naming the file; a bad line anywhere else is corruption, a `VerlError`
naming the file and line. `drop_partial_tail` cuts the partial line off before a writer appends, so the
next row never lands on the end of a broken one. (User datasets are read by `verl.data.readers`, which
reports bad rows with the data report instead.)
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from verl.errors import VerlError


class JsonlError(VerlError):
    """A line of verl's own JSON Lines file (not the last one) is not JSON: the file is corrupt."""


def _partial_warning(path: Path, lineno: int, why: str) -> None:
    warnings.warn(f"{path}: dropped a partial last line (line {lineno}: {why}), most likely left by a crash in "
                  "the middle of a write; the rows before it are kept", stacklevel=3)


def read_jsonl(path: str | Path) -> list[Any]:
    """The rows of `path` (blank lines skipped). A partial last line is dropped with one warning naming the
    file; an unreadable line before the last raises `JsonlError` naming the file and line."""
    path = Path(path)
    with path.open("rb") as fh:
        data = fh.read()
    lines = data.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows: list[Any] = []
    for i, raw in enumerate(lines[: last + 1]):
        if not raw.strip():
            continue
        try:
            rows.append(json.loads(raw.decode("utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if i == last:
                _partial_warning(path, i + 1, str(exc))
                break
            raise JsonlError(
                f"{path}:{i + 1}: not a JSON line ({exc}); the file is corrupt before its last line, so it was not "
                "left by a crash mid-write. Fix: delete or repair that line (the rows around it are intact)"
            ) from None
    return rows


def drop_partial_tail(path: str | Path) -> bool:
    """Cut a partial last line off `path` (with `read_jsonl`'s one warning), so an append starts on a line of
    its own; a complete last line without its newline gets the newline. True when the file changed."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return False
    with path.open("rb") as fh:
        data = fh.read()
    if data.endswith(b"\n"):
        return False
    start = data.rfind(b"\n") + 1
    tail = data[start:]
    try:
        json.loads(tail.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        if tail.strip():
            _partial_warning(path, data.count(b"\n") + 1, str(exc))
        with path.open("r+b") as fh:
            fh.truncate(start)
            fh.flush()
            os.fsync(fh.fileno())
        return True
    with path.open("ab") as fh:
        fh.write(b"\n")
    return True


__all__ = ["JsonlError", "drop_partial_tail", "read_jsonl"]
