"""Reading a JSON Lines file that a run is still writing, one poll at a time, from where the last poll stopped.

The viewer polls every few seconds, so re-reading a 1 GB file each time is not an option: the reader keeps its
byte offset and reads only what was appended since. A last line without its newline is being written: it is
left for the next poll. A file that shrank or was replaced (a fresh run rotates `metrics.jsonl` to
`metrics.jsonl.1`; a resume rewrites it) starts over, and the caller is told so it drops what it built. Bad
lines (not JSON, not an object, over `max_line` bytes, bytes that are not UTF-8) never stop the reader: they
are counted and the first few described, since a viewer that fails on one odd line shows nothing at all.
"""

from __future__ import annotations

import json
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_LINE_BYTES = 64 * 1024 * 1024  # a row this large is a bug upstream, not something to show
CHUNK_BYTES = 1 << 20
# `polls` hands over the rows of this many bytes at a time: the parsed rows of one slice are all a reader holds
SLICE_BYTES = 16 << 20
MAX_PROBLEMS_KEPT = 20


@dataclass
class Line:
    """One complete row: where it starts in the file, its length in bytes (with the newline), its object."""

    offset: int
    length: int
    row: dict[str, Any]


@dataclass
class Poll:
    """What one poll found: the new rows, and whether the file was replaced (drop everything built so far)."""

    lines: list[Line] = field(default_factory=list)
    reset: bool = False


def parse_line(raw: bytes) -> dict[str, Any]:
    """One row as a dict. Bytes that are not UTF-8 become U+FFFD (a model may write anything); NaN and
    Infinity, which Python's json writes, are accepted. Raises ValueError for anything that is not an object."""
    row = json.loads(raw.decode("utf-8", errors="replace"))
    if not isinstance(row, dict):
        raise ValueError(f"a JSON {type(row).__name__}, not an object")
    return row


class JsonlTail:
    """The rows appended to `path` since the last `poll()`; see the module docstring."""

    def __init__(self, path: str | Path, *, max_line: int = MAX_LINE_BYTES, chunk: int = CHUNK_BYTES) -> None:
        self.path = Path(path)
        self.max_line, self.chunk = max_line, chunk
        self.offset = 0
        self.generation = 0  # bumped each time the file is found replaced
        self.bad_lines = 0
        self.problems: list[str] = []
        self._ident: tuple[int, int] | None = None
        self._skipping = False  # inside a line over max_line: drop bytes until its newline

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def _restart(self) -> None:
        self.offset, self._skipping, self.bad_lines, self.problems = 0, False, 0, []
        self.generation += 1

    def _problem(self, offset: int, why: str) -> None:
        self.bad_lines += 1
        if len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems.append(f"{self.path.name} at byte {offset}: {why}")

    def poll(self, max_bytes: int | None = None) -> Poll:
        """Read the complete lines appended since the last poll (at most about `max_bytes` of them, so a huge
        file is indexed over several polls instead of blocking one request)."""
        poll = Poll()
        try:
            st = os.stat(self.path)
        except OSError:  # not written yet, or moved away: whatever comes next is a new file
            if self._ident is not None:
                self._ident = None
                self._restart()
                poll.reset = True
            return poll
        ident = (st.st_dev, st.st_ino)
        if self._ident is not None and (ident != self._ident or st.st_size < self.offset):
            self._restart()
            poll.reset = True
        self._ident = ident
        if st.st_size <= self.offset:
            return poll
        budget = st.st_size - self.offset if max_bytes is None else min(max_bytes, st.st_size - self.offset)
        with self.path.open("rb") as fh:
            fh.seek(self.offset)
            self._read(fh, budget, poll)
        return poll

    def polls(self, max_bytes: int | None = None, slice_bytes: int = SLICE_BYTES) -> Iterator[Poll]:
        """`poll()`s of at most `slice_bytes` each, until about `max_bytes` are read (None: all that is there):
        the caller indexes each slice's rows before the next is parsed, so a large file never sits in memory
        as parsed rows."""
        read = 0
        while max_bytes is None or read < max_bytes:
            start = self.offset
            poll = self.poll(slice_bytes if max_bytes is None else min(slice_bytes, max_bytes - read))
            yield poll
            moved = self.offset if poll.reset else self.offset - start
            if moved <= 0:
                return
            read += moved

    def _read(self, fh, budget: int, poll: Poll) -> None:
        end = self.offset + budget  # stop at the first line end at or past this
        pending = b""  # bytes of the current line read so far, starting at self.offset
        while pending or self.offset < end:
            data = fh.read(self.chunk)
            if not data:
                return  # EOF inside a line: it is still being written; read it next time
            if self._skipping:
                cut = data.find(b"\n")
                if cut < 0:
                    self.offset += len(data)
                    continue
                self.offset += cut + 1
                self._skipping = False
                data = data[cut + 1:]
            pending += data
            start = 0
            while (cut := pending.find(b"\n", start)) >= 0:
                raw = pending[start:cut]
                if raw.strip():
                    self._emit(raw, poll)
                self.offset += cut + 1 - start
                start = cut + 1
                if self.offset >= end:
                    return  # the rest of this chunk is read again by the next poll
            pending = pending[start:]
            if len(pending) > self.max_line:
                self._problem(self.offset, f"a line over {self.max_line} bytes, skipped")
                self.offset += len(pending)
                pending, self._skipping = b"", True

    def _emit(self, raw: bytes, poll: Poll) -> None:
        if len(raw) > self.max_line:
            self._problem(self.offset, f"a line over {self.max_line} bytes, skipped")
            return
        try:
            row = parse_line(raw)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            self._problem(self.offset, f"not a JSON object ({exc})")
            return
        poll.lines.append(Line(self.offset, len(raw) + 1, row))


def read_at(path: Path, offset: int, length: int) -> dict[str, Any] | None:
    """The row stored at `offset` (from an index built by a `JsonlTail`), or None when the file changed."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            raw = fh.read(length)
        return parse_line(raw)
    except (OSError, ValueError):
        return None


class TailIndex(ABC):
    """A reader kept up to date from its `tail`: `refresh()` hands it what was appended, a slice at a time
    (`_add` per row; `_clear` first when the file was replaced), reading at most `index_bytes` per call."""

    tail: JsonlTail
    lock: threading.Lock
    index_bytes: int | None = None

    def refresh(self) -> None:
        with self.lock:
            for poll in self.tail.polls(self.index_bytes):
                if poll.reset:
                    self._clear()
                for line in poll.lines:
                    self._add(line)

    @abstractmethod
    def _clear(self) -> None:
        """Forget every row indexed so far (the file was replaced)."""

    @abstractmethod
    def _add(self, line: Line) -> None:
        """Index one complete row."""


__all__ = ["JsonlTail", "Line", "MAX_LINE_BYTES", "Poll", "TailIndex", "parse_line", "read_at"]
