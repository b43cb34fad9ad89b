"""Readers for .jsonl/.ndjson, .json, .parquet, .csv and .arrow files (and folders of them).

Each reader yields `Record`s: one per row, carrying either the parsed object or the reason it could not
be parsed, plus the 1-based line (row for Parquet and Arrow) so a report can point at it, and where the
row starts in its file (`pos`) so it can be read again on demand (`verl.data.index`). Problems that make a
whole file unusable (missing file, UTF-16, a broken JSON array, a corrupt Parquet footer) raise
DataError at once. JSONL, CSV, Parquet and Arrow stream; a .json array is read whole, as it must be
parsed whole. A folder is either a folder of such files or a Hugging Face `save_to_disk` folder
(`verl.data.hf`).
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl.data import hf
from verl.errors import DataError

EXTENSIONS: dict[str, str] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
UTF8_BOM = b"\xef\xbb\xbf"
_WS = re.compile(r"[ \t\n\r]*")
CSV_FIELD_LIMIT = 1 << 30


@dataclass
class Record:
    """One row as read: `value` when it parsed, else `error` = (reason code, detail).

    `pos` is where the row can be read again: the byte offset of its line (JSONL, CSV), its 0-based row
    (Parquet, Arrow, a Python dataset); -1 when it cannot be addressed (a .json list, parsed whole)."""

    file: str
    line: int
    value: Any = None
    error: tuple[str, str] | None = None
    pos: int = -1


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return d


def parse_json_line(text: str) -> tuple[Any, tuple[str, str] | None]:
    """Parse one JSON value; returns (value, None) or (None, (code, detail)). Never raises."""
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook), None
    except _DuplicateKey as e:
        return None, ("duplicate_key", f"key {e.key!r} appears twice in the object")
    except json.JSONDecodeError as e:
        return None, ("malformed_json", f"invalid JSON: {e.msg} at column {e.colno}")
    except RecursionError:
        return None, ("malformed_json", "invalid JSON: nested too deeply to parse")
    except ValueError as e:  # e.g. an integer literal longer than Python's 4300-digit limit
        return None, ("malformed_json", f"invalid JSON: {str(e).split(';')[0]}")


def _check_not_utf16(head: bytes, path: str) -> None:
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DataError(
            f"{path}: the file is UTF-16 encoded (it starts with a UTF-16 byte-order mark); verl reads "
            "UTF-8. Re-save it as UTF-8 (e.g. `iconv -f utf-16 -t utf-8 IN > OUT`)."
        )


def expand_paths(
    paths: str | os.PathLike[str] | list[str | os.PathLike[str]], purpose: str = "train"
) -> tuple[list[str], list[str]]:
    """Files to read (folders expanded recursively, sorted) and files skipped for their extension.

    A Hugging Face `save_to_disk` folder gives its arrow shards; `folder:split` picks a DatasetDict's
    split, else the split named for `purpose` ('train', or 'val': validation/valid/val/test/eval)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise DataError(
            "no data files given; set data.train_files to a list of .jsonl/.json/.parquet/.csv/.arrow paths "
            "or save_to_disk folders"
        )
    files: list[str] = []
    ignored: list[str] = []
    for p in paths:
        base, split = hf.split_suffix(str(p))
        path = Path(base)
        if split is not None:
            if not path.is_dir():
                raise DataError(f"data file {p} does not exist (nor does the folder {path}); check the path in "
                                "data.train_files/val_files")
            files.extend(hf.folder_files(path, split, purpose))
        elif path.is_dir():
            found = _expand_dir(path, path, purpose, ignored)
            if not found:
                raise DataError(
                    f"folder {path} holds no data files (found: {hf.found_listing(path)}). Expected "
                    f"{', '.join(e for e in EXTENSIONS if e != '.arrow')} files (in it or its subfolders), or "
                    f"{hf.LAYOUT_HELP}. Point data.train_files at the files or at such a folder"
                )
            files.extend(found)
        elif path.is_file():
            if path.suffix.lower() not in EXTENSIONS:
                raise DataError(
                    f"{path}: unsupported file type {path.suffix or '(no extension)'!r}; verl reads "
                    f"{', '.join(EXTENSIONS)} files and Hugging Face save_to_disk folders. Rename or convert "
                    "the file."
                )
            files.append(str(path))
        else:
            raise DataError(f"data file {path} does not exist; check the path in data.train_files/val_files")
    return files, ignored


def _expand_dir(folder: Path, top: Path, purpose: str, ignored: list[str]) -> list[str]:
    """Data files under `folder` in path order; a save_to_disk folder counts as its shards. Loose .arrow
    files outside such a folder are refused: a `datasets` cache folder holds shards of several tables
    (and cache-*.arrow files of .map() results) that must not be read as one dataset."""
    kind = hf.layout(folder)
    if kind is not None:
        return hf.folder_files(folder, None, purpose)
    if (folder / hf.INFO).is_file():
        raise DataError(f"{folder} holds {hf.INFO} but no {hf.STATE} or {hf.DICT} (found: "
                        f"{hf.found_listing(folder)}): an incomplete Hugging Face dataset folder; {hf.LAYOUT_HELP}. "
                        "Copy the whole folder again or re-save it with save_to_disk")
    out: list[str] = []
    arrows: list[str] = []
    for sub in sorted(folder.iterdir()):
        if sub.name.startswith("."):
            continue
        if sub.is_dir():
            out.extend(_expand_dir(sub, top, purpose, ignored))
        elif sub.is_file():
            ext = sub.suffix.lower()
            if ext == ".arrow":
                arrows.append(sub.name)
            (out if ext in EXTENSIONS else ignored).append(str(sub))
    if arrows:
        raise DataError(f"{folder} holds Arrow files ({', '.join(arrows[:4])}{' ...' if len(arrows) > 4 else ''}) "
                        f"but no {hf.STATE}: an unknown layout (found: {hf.found_listing(folder)}). Expected "
                        f"{hf.LAYOUT_HELP}. Point data.train_files at the save_to_disk folder, or at the .arrow "
                        "files themselves if each is a table to read")
    return out


def iter_records(
    path: str, notes: list[str] | None = None, blank: list[int] | None = None
) -> Iterator[Record]:
    """Yield the records of one file; `notes` collects remarks, `blank[0]` counts skipped blank lines."""
    fmt = EXTENSIONS.get(Path(path).suffix.lower())
    if fmt is None:
        raise DataError(f"{path}: unsupported file type; verl reads {', '.join(EXTENSIONS)}")
    notes = notes if notes is not None else []
    blank = blank if blank is not None else [0]
    if fmt == "jsonl":
        return _iter_jsonl(path, blank)
    if fmt == "json":
        return _iter_json(path, notes, blank)
    if fmt == "parquet":
        return _iter_parquet(path)
    if fmt == "arrow":
        return _iter_arrow(path)
    return _iter_csv(path, blank)


def _iter_jsonl(path: str, blank: list[int]) -> Iterator[Record]:
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed in finally; generator streams lines
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror}); check the path and permissions") from None
    with f:
        _check_not_utf16(f.read(2), path)
        f.seek(0)
        yield from _jsonl_lines(f, path, blank)


def _jsonl_lines(lines: Any, path: str, blank: list[int], first_line: int = 1) -> Iterator[Record]:
    offset = 0  # byte offset of the line (binary lines only: text lines come from a .json read whole)
    for lineno, raw in enumerate(lines, first_line):
        pos, offset = (offset, offset + len(raw)) if isinstance(raw, bytes) else (-1, offset)
        if isinstance(raw, bytes):
            if lineno == first_line and raw.startswith(UTF8_BOM):
                raw = raw[3:]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Record(
                    path,
                    lineno,
                    error=("not_utf8", f"byte {e.start + 1} of the line (0x{raw[e.start]:02x}) is not UTF-8"),
                    pos=pos,
                )
                continue
        else:
            text = raw
        text = text.strip(" \t\r\n\ufeff")
        if not text:
            blank[0] += 1
            continue
        value, err = parse_json_line(text)
        if err is None and not isinstance(value, dict):
            err = ("not_an_object", f"the line holds a JSON {type(value).__name__}, not an object")
        yield Record(path, lineno, value=value if err is None else None, error=err, pos=pos)


def _iter_json(path: str, notes: list[str], blank: list[int]) -> Iterator[Record]:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror}); check the path and permissions") from None
    _check_not_utf16(data[:2], path)
    if data.startswith(UTF8_BOM):
        data = data[3:]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{path}:{line}: byte 0x{data[e.start]:02x} is not valid UTF-8; re-save the file as UTF-8"
        ) from None
    dec = json.JSONDecoder(object_pairs_hook=_pairs_hook)
    pos = _WS.match(text, 0).end()  # type: ignore[union-attr]
    if pos == len(text):
        return
    if text[pos] == "{":
        # Either a single object or JSON Lines saved with a .json extension.
        _, end = _decode_at(dec, text, pos, path)
        rest = _WS.match(text, end).end()  # type: ignore[union-attr]
        if rest == len(text):
            raise DataError(
                f"{path}: the file holds a single JSON object, not a list of rows; write a list "
                "`[{...}, {...}]` or one object per line in a .jsonl file"
            )
        notes.append(
            f"{path} holds one JSON object per line; it was read as JSON Lines (rename it to .jsonl)"
        )
        yield from _jsonl_lines(text.splitlines(), path, blank)
        return
    if text[pos] != "[":
        raise DataError(
            f"{path}:{_line_of(text, pos)}: a .json file must hold a list of objects `[{{...}}, ...]`, "
            f"found {text[pos]!r}; use .jsonl for one object per line"
        )
    pos += 1
    line, counted_to = 1, 0
    first = True
    while True:
        pos = _WS.match(text, pos).end()  # type: ignore[union-attr]
        if pos >= len(text):
            raise DataError(f"{path}:{_line_of(text, pos)}: the JSON list is not closed with ']'")
        if text[pos] == "]":
            break
        if not first:
            if text[pos] != ",":
                raise DataError(
                    f"{path}:{_line_of(text, pos)}: invalid JSON: expected ',' or ']' between list items"
                )
            pos = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
        first = False
        line += text.count("\n", counted_to, pos)
        counted_to = pos
        value, pos = _decode_at(dec, text, pos, path)
        if isinstance(value, dict):
            yield Record(path, line, value=value)
        else:
            yield Record(
                path,
                line,
                error=("not_an_object", f"list item is a JSON {type(value).__name__}, not an object"),
            )
    tail = _WS.match(text, pos + 1).end()  # type: ignore[union-attr]
    if tail != len(text):
        raise DataError(f"{path}:{_line_of(text, tail)}: unexpected data after the closing ']'")


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _decode_at(dec: json.JSONDecoder, text: str, pos: int, path: str) -> tuple[Any, int]:
    try:
        return dec.raw_decode(text, pos)
    except _DuplicateKey as e:
        raise DataError(
            f"{path}:{_line_of(text, pos)}: key {e.key!r} appears twice in one object; keep one"
        ) from None
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}:{e.lineno}: invalid JSON: {e.msg} at column {e.colno}; the whole list cannot be read "
            "past this point, fix it (or convert the file to .jsonl so one bad row does not stop the rest)"
        ) from None
    except RecursionError:
        raise DataError(f"{path}:{_line_of(text, pos)}: JSON nested too deeply to parse") from None
    except ValueError as e:  # e.g. an integer literal longer than Python's 4300-digit limit
        raise DataError(f"{path}:{_line_of(text, pos)}: invalid JSON: {str(e).split(';')[0]}") from None


def _iter_parquet(path: str) -> Iterator[Record]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        raise DataError(f"{path}: reading Parquet needs pyarrow; `pip install pyarrow`") from None
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e}); re-export it") from None
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=1024):
            for value in batch.to_pylist():
                row += 1
                yield Record(path, row, value=value, pos=row - 1)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(
            f"{path} row {row + 1}: Parquet data cannot be decoded ({e}); re-export the file"
        ) from None


ARROW_FILE_MAGIC = b"ARROW1"


def open_arrow(path: str, mapped: Any = None) -> Any:
    """A record-batch reader of an Arrow IPC file: the stream format (what `datasets` writes) or the file
    format (magic ARROW1). Over `mapped` (an `mmap` of the file) batches are views of the mapping, whose
    pages are read only as rows are used; else batches are read one by one into memory, for a single pass
    that holds only the current batch."""
    import pyarrow as pa

    try:
        with open(path, "rb") as f:
            head = f.read(6)
        source = pa.BufferReader(pa.py_buffer(mapped)) if mapped is not None else pa.OSFile(path)
        if head == ARROW_FILE_MAGIC:
            return pa.ipc.open_file(source)
        return pa.ipc.open_stream(source)
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e}); check the path and permissions") from None
    except (pa.ArrowException, ValueError) as e:
        raise DataError(f"{path}: not a readable Arrow IPC file ({e}); re-save the dataset (save_to_disk) "
                        "or re-export the file") from None


def arrow_batches(reader: Any) -> Iterator[Any]:
    """Record batches of a reader from `open_arrow`, whichever format it reads."""
    if hasattr(reader, "num_record_batches"):
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader


def _iter_arrow(path: str) -> Iterator[Record]:
    import pyarrow as pa

    reader = open_arrow(path)
    row = 0
    try:
        for batch in arrow_batches(reader):
            for start in range(0, batch.num_rows, 1024):
                for value in batch.slice(start, 1024).to_pylist():
                    row += 1
                    yield Record(path, row, value=value, pos=row - 1)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(f"{path} row {row + 1}: Arrow data cannot be decoded ({e}); re-save the dataset") from None


def _iter_csv(path: str, blank: list[int]) -> Iterator[Record]:
    if csv.field_size_limit() < CSV_FIELD_LIMIT:
        csv.field_size_limit(CSV_FIELD_LIMIT)  # allow very long cells (a 10 MB prompt is legitimate)
    bad_lines: list[int] = []
    line_at: dict[int, int] = {}  # line number -> byte offset, for the lines of the record being parsed

    def lines(f: Any) -> Iterator[str]:
        offset = 0
        for i, raw in enumerate(f, 1):
            line_at[i], offset = offset, offset + len(raw)
            if i == 1 and raw.startswith(UTF8_BOM):
                raw = raw[3:]
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError:
                bad_lines.append(i)
                yield raw.decode("utf-8", "replace")

    try:
        f = open(path, "rb")  # noqa: SIM115
    except OSError as e:
        raise DataError(f"{path}: cannot open ({e.strerror}); check the path and permissions") from None
    with f:
        _check_not_utf16(f.read(2), path)
        f.seek(0)
        reader = csv.reader(lines(f))
        header: list[str] | None = None
        prev = 0
        while True:
            try:
                cells = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                raise DataError(
                    f"{path}:{reader.line_num}: CSV cannot be parsed ({e}); check the quoting"
                ) from None
            start, prev = prev + 1, reader.line_num
            pos = line_at.get(start, -1)
            for ln in [ln for ln in line_at if ln <= prev]:
                del line_at[ln]
            if not cells:
                blank[0] += 1
                continue
            bad = [ln for ln in bad_lines if start <= ln <= prev]
            bad_lines.clear()
            if header is None:
                if bad:
                    raise DataError(
                        f"{path}:{bad[0]}: the CSV header is not valid UTF-8; re-save the file as UTF-8"
                    )
                header = cells
                seen: dict[str, int] = {}
                for i, name in enumerate(header, 1):
                    if name in seen:
                        raise DataError(
                            f"{path}:{start}: the CSV header has column {name!r} twice (columns {seen[name]} "
                            f"and {i}); rename one"
                        )
                    seen[name] = i
                continue
            if bad:
                yield Record(
                    path, start, error=("not_utf8", f"line {bad[0]} of the record is not valid UTF-8"), pos=pos
                )
            elif len(cells) != len(header):
                yield Record(
                    path,
                    start,
                    error=("csv_columns", f"the row has {len(cells)} cells but the header has {len(header)}"),
                    pos=pos,
                )
            else:
                yield Record(path, start, value=dict(zip(header, cells, strict=False)), pos=pos)


__all__ = ["Record", "EXTENSIONS", "arrow_batches", "expand_paths", "iter_records", "open_arrow", "parse_json_line"]
