"""Checked rows that stay in their files: an index of where each good row is, read back on demand.

An RL trainer draws a few hundred prompts per step in a shuffled order, so it needs rows by index, not
all of them in memory. The start-up pass streams every row through the usual checks (the report names
each bad row by file and line) and keeps, per good row, only where it is: the file, the byte offset of
its line (JSONL, CSV) or its row (Parquet, Arrow, a Python dataset), and its line for messages -- about
24 bytes a row instead of the row. `RowIndex[i]` reads the row again (Arrow shards memory-mapped, JSONL
by `os.pread`), normalises it with the same `RowNormalizer` and returns a fresh dict. A .json list has no
row offsets (it is parsed whole), so its rows are held in memory as before.

Each row's data_source and whether it has a ground truth are kept too (small arrays), because the
environment checks every row for them at start-up and must not read the files a second time to do so.
"""

from __future__ import annotations

import abc
import csv
import mmap
import os
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from verl.data.fields import RowError, RowNormalizer
from verl.data.readers import (
    CSV_FIELD_LIMIT,
    EXTENSIONS,
    UTF8_BOM,
    arrow_batches,
    open_arrow,
    parse_json_line,
)
from verl.data.report import location
from verl.errors import DataError

_CHUNK = 1 << 16


@dataclass(frozen=True)
class RowFacts:
    """What the start-up checks need of a row without reading it: its data_source, whether it has a
    ground truth, and where it is (for messages)."""

    data_source: str | None
    has_ground_truth: bool
    file: str | None
    line: int | None


class _Source(abc.ABC):
    """One file (or Python dataset) rows are read back from: `read(positions)` -> raw values, in order."""

    fmt = ""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stat: tuple[int, int] | None = None
        if not name.startswith("<"):
            st = os.stat(name)
            self.stat = (st.st_size, st.st_mtime_ns)

    def check_unchanged(self) -> None:
        """The index points into the file as it was checked: a rewritten file would give other rows."""
        if self.stat is None:
            return
        try:
            st = os.stat(self.name)
            now = (st.st_size, st.st_mtime_ns)
        except OSError:
            now = None
        if now != self.stat:
            raise DataError(f"{self.name} changed (or was removed) after it was checked at start-up; the rows are "
                            "read from it during training, so it must stay as it was. Restart the run to check "
                            "it again, and write new data to a new file")

    @abc.abstractmethod
    def read(self, positions: Sequence[int]) -> list[Any]:
        """The raw rows at `positions` (the source's own row numbers), in that order."""

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_cache")}


class _JsonlSource(_Source):
    fmt = "jsonl"

    def read(self, positions: Sequence[int]) -> list[Any]:
        fd = os.open(self.name, os.O_RDONLY)
        try:
            out = []
            for pos in positions:
                buf = b""
                while True:  # pread: no shared file offset, so forked workers can read at once
                    chunk = os.pread(fd, _CHUNK, pos + len(buf))
                    buf += chunk
                    end = buf.find(b"\n")
                    if end >= 0 or not chunk:
                        buf = buf if end < 0 else buf[:end]
                        break
                if pos == 0 and buf.startswith(UTF8_BOM):
                    buf = buf[3:]
                value, err = parse_json_line(buf.decode("utf-8", "replace").strip(" \t\r\n\ufeff"))
                out.append(None if err else value)
            return out
        finally:
            os.close(fd)


class _CsvSource(_Source):
    fmt = "csv"

    def __init__(self, name: str, header: list[str]) -> None:
        super().__init__(name)
        self.header = header

    def read(self, positions: Sequence[int]) -> list[Any]:
        if csv.field_size_limit() < CSV_FIELD_LIMIT:
            csv.field_size_limit(CSV_FIELD_LIMIT)
        out = []
        with open(self.name, "rb") as f:
            for pos in positions:
                f.seek(pos)
                lines = (raw.decode("utf-8", "replace") for raw in f)
                try:
                    cells = next(csv.reader(lines))
                except (StopIteration, csv.Error):
                    cells = []
                out.append(dict(zip(self.header, cells, strict=False)) if len(cells) == len(self.header) else None)
        return out


class _ParquetSource(_Source):
    fmt = "parquet"

    def read(self, positions: Sequence[int]) -> list[Any]:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(self.name)
        starts = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
        groups: dict[int, list[int]] = {}
        for j, pos in enumerate(positions):
            groups.setdefault(int(np.searchsorted(starts, pos, side="right")) - 1, []).append(j)
        out: list[Any] = [None] * len(positions)
        for g, js in groups.items():  # one decode per row group the rows fall in
            table = pf.read_row_group(g)
            rows = table.take([int(positions[j] - starts[g]) for j in js]).to_pylist()
            for j, row in zip(js, rows, strict=True):
                out[j] = row
        return out


class _ArrowSource(_Source):
    fmt = "arrow"

    def _batches(self) -> tuple[list[Any], np.ndarray, mmap.mmap]:
        cached = getattr(self, "_cache_batches", None)
        if cached is None:  # batches are views of the memory map: only the pages of the rows taken are read
            with open(self.name, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                mapped.madvise(mmap.MADV_RANDOM)  # rows are read at random: no read-ahead around each one
            batches = list(arrow_batches(open_arrow(self.name, mapped)))
            cached = self._cache_batches = (batches, np.cumsum([0] + [b.num_rows for b in batches]), mapped)
        return cached

    def read(self, positions: Sequence[int]) -> list[Any]:
        # Row by row within its record batch: a take over the whole table would first concatenate every
        # batch (reading, and copying, the whole file).
        batches, starts, mapped = self._batches()
        release = hasattr(mapped, "madvise") and hasattr(mmap, "MADV_DONTNEED")
        out = []
        for j, pos in enumerate(positions, 1):
            b = int(np.searchsorted(starts, pos, side="right")) - 1
            out.append(batches[b].slice(int(pos - starts[b]), 1).to_pylist()[0])
            if release and (j % 16 == 0 or j == len(positions)):
                # The rows are Python objects now: unmap the pages read (they stay in the page cache), so the
                # process's memory does not grow toward the file size as an epoch touches every page (the
                # kernel maps 64 KB around each page a row is read from).
                mapped.madvise(mmap.MADV_DONTNEED)
        return out


class _DatasetSource(_Source):
    """A Python `datasets.Dataset` (or a list of rows): rows by index, as the caller's object gives them."""

    fmt = "python"

    def __init__(self, name: str, dataset: Any) -> None:
        super().__init__(name)
        self.dataset = dataset

    def read(self, positions: Sequence[int]) -> list[Any]:
        return [self.dataset[int(p)] for p in positions]


class _HeldSource(_Source):
    """Rows of a file without row offsets (a .json list): the canonical rows themselves."""

    fmt = "held"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.rows: list[dict[str, Any]] = []

    def read(self, positions: Sequence[int]) -> list[Any]:
        return [self.rows[p] for p in positions]


_SOURCES = {"jsonl": _JsonlSource, "parquet": _ParquetSource, "arrow": _ArrowSource}


class RowIndex(Sequence):
    """Canonical rows by index, read from their files on demand (see the module docstring).

    `rows[i]` and `rows.get_many(indices)` return fresh dicts (a caller may change them); `rows.subset(idx)`
    is a view on some of the rows (a hold-out split); `rows.facts()` gives each row's data_source and
    ground-truth presence without reading it.
    """

    def __init__(self, kind: str, fields: dict[str, str] | None = None) -> None:
        self.kind, self.fields = kind, fields
        self._normalizer = RowNormalizer(kind, fields, check_images=False)  # checked at start-up
        self._sources: list[_Source] = []
        self._by_name: dict[str, int] = {}
        self._src = array("i")
        self._pos = array("q")
        self._line = array("q")
        self._ds = array("i")  # index into _ds_values (0 = None)
        self._gt = array("b")
        self._ds_values: list[str | None] = [None]
        self._ds_code: dict[str | None, int] = {None: 0}
        self._view: np.ndarray | None = None  # a subset: indices into the arrays above

    # ------------------------------------------------------------------ building
    def add_dataset(self, name: str, dataset: Any) -> None:
        """Register a Python dataset whose rows are added with `add(name, row_index, ...)`."""
        self._by_name[name] = len(self._sources)
        self._sources.append(_DatasetSource(name, dataset))

    def add(self, file: str, pos: int, line: int, raw: Any, row: dict[str, Any]) -> None:
        """Index a row that passed every check: `raw` is the value read, `row` its canonical form."""
        si = self._by_name.get(file)
        if si is None:
            fmt = EXTENSIONS.get(os.path.splitext(file)[1].lower(), "")
            if pos < 0:
                source: _Source = _HeldSource(file)
            elif fmt == "csv":
                source = _CsvSource(file, list(raw))
            else:
                source = _SOURCES[fmt](file)
            si = self._by_name[file] = len(self._sources)
            self._sources.append(source)
        source = self._sources[si]
        if isinstance(source, _HeldSource):
            pos = len(source.rows)
            source.rows.append(row)
        self._src.append(si)
        self._pos.append(pos)
        self._line.append(line)
        if self.kind == "prompt":
            ds = row.get("data_source")
            code = self._ds_code.get(ds)
            if code is None:
                code = self._ds_code[ds] = len(self._ds_values)
                self._ds_values.append(ds)
            self._ds.append(code)
            self._gt.append(row.get("ground_truth") is not None)

    def finish(self) -> RowIndex:
        """Done adding: the arrays become numpy arrays (half the memory of a growing array at worst)."""
        self._src_np = np.frombuffer(self._src, dtype=np.int32) if len(self._src) else np.zeros(0, np.int32)
        self._pos_np = np.frombuffer(self._pos, dtype=np.int64) if len(self._pos) else np.zeros(0, np.int64)
        self._line_np = np.frombuffer(self._line, dtype=np.int64) if len(self._line) else np.zeros(0, np.int64)
        self._ds_np = np.frombuffer(self._ds, dtype=np.int32) if len(self._ds) else np.zeros(0, np.int32)
        self._gt_np = np.frombuffer(self._gt, dtype=np.int8) if len(self._gt) else np.zeros(0, np.int8)
        return self

    # ------------------------------------------------------------------ reading
    def _base(self, i: int) -> int:
        return int(self._view[i]) if self._view is not None else i

    def __len__(self) -> int:
        return len(self._view) if self._view is not None else len(self._src_np)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.subset(range(len(self))[i])
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        return self.get_many([i % n])[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for start in range(0, len(self), 1024):
            yield from self.get_many(range(start, min(start + 1024, len(self))))

    def get_many(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The rows at `indices` (fresh dicts, in that order); rows of one file are read together."""
        base = [self._base(int(i)) for i in indices]
        by_source: dict[int, list[int]] = {}
        for j, b in enumerate(base):
            by_source.setdefault(int(self._src_np[b]), []).append(j)
        out: list[Any] = [None] * len(base)
        for si, js in by_source.items():
            source = self._sources[si]
            if isinstance(source, _HeldSource):
                for j in js:
                    out[j] = _fresh(source.rows[int(self._pos_np[base[j]])])
                continue
            source.check_unchanged()
            raws = source.read([int(self._pos_np[base[j]]) for j in js])
            for j, raw in zip(js, raws, strict=True):
                out[j] = self._canonical(source, base[j], raw)
        return out

    def _canonical(self, source: _Source, b: int, raw: Any) -> dict[str, Any]:
        line = int(self._line_np[b])
        try:
            if not isinstance(raw, dict):
                raise RowError("changed", None, "the row can no longer be parsed")
            row, _ = self._normalizer.normalize(raw, None if source.name.startswith("<") else
                                                os.path.dirname(os.path.abspath(source.name)))
        except RowError as e:
            raise DataError(f"{location(source.name, line)}: the row no longer passes the checks it passed at "
                            f"start-up ({e.detail}); the data changed while the run used it. Restart the run") from None
        row["line"], row["file"] = line, source.name
        return row

    def subset(self, indices: Sequence[int]) -> RowIndex:
        """A view on the rows at `indices` (of this sequence), sharing the files and arrays."""
        view = object.__new__(RowIndex)
        view.__dict__.update(self.__dict__)
        idx = np.asarray(list(indices) if not isinstance(indices, np.ndarray) else indices, dtype=np.int64)
        view._view = (self._view[idx] if self._view is not None else idx) if len(idx) else np.zeros(0, np.int64)
        return view

    def facts(self) -> Iterator[RowFacts]:
        """Each row's data_source and ground-truth presence, from the arrays kept at start-up."""
        rows = self._view if self._view is not None else range(len(self._src_np))
        for b in rows:
            b = int(b)
            has_facts = len(self._ds_np) > b
            yield RowFacts(self._ds_values[int(self._ds_np[b])] if has_facts else None,
                           bool(self._gt_np[b]) if has_facts else False,
                           self._sources[int(self._src_np[b])].name, int(self._line_np[b]))

    @property
    def files(self) -> list[str]:
        return [s.name for s in self._sources]

    def nbytes(self) -> int:
        """Memory of the index itself (not counting .json rows held whole)."""
        return sum(a.nbytes for a in (self._src_np, self._pos_np, self._line_np, self._ds_np, self._gt_np))


def _fresh(row: dict[str, Any]) -> dict[str, Any]:
    import copy

    return copy.deepcopy(row)


def row_facts(rows: Sequence[Any]) -> Iterator[RowFacts]:
    """`facts()` of a lazy row sequence, or the same read off rows in memory (dicts)."""
    facts = getattr(rows, "facts", None)
    if facts is not None:
        yield from facts()
        return
    for row in rows:
        get = row.get if hasattr(row, "get") else (lambda _key: None)
        yield RowFacts(get("data_source"), get("ground_truth") is not None, get("file"), get("line"))


def rows_at(rows: Sequence[Any], indices: Sequence[int]) -> list[Any]:
    """rows[i] for each index: a lazy sequence reads them together, rows in memory are indexed."""
    get_many = getattr(rows, "get_many", None)
    return get_many(indices) if get_many is not None else [rows[i] for i in indices]


def is_lazy(rows: Any) -> bool:
    """Rows read on demand (a fresh dict per access), not held in memory."""
    return hasattr(rows, "get_many") and hasattr(rows, "subset")


__all__ = ["RowFacts", "RowIndex", "is_lazy", "row_facts", "rows_at"]
