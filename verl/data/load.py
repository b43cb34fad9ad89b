"""Reading data files into canonical rows, with a report of every row that was not kept.

`iter_rows` streams (it is what `verl data normalize` uses on multi-GB files); `index_rows` is what the
trainers call: it streams the same checks and keeps only where each good row is (`verl.data.index`), then
turns the report into a DataError when the policy says so. `load_rows` does the same holding the rows in
memory; `index_dataset` takes a Python `datasets.Dataset` instead of files.
"""

from __future__ import annotations

import json
import os
import tempfile
from array import array
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from verl.data import hf, images
from verl.data.chat import encode_prompt, template_mode
from verl.data.fields import RowError, RowNormalizer, check_kind
from verl.data.index import RowIndex
from verl.data.readers import Record, expand_paths, iter_records
from verl.data.report import DataReport, TokenStats
from verl.errors import ConfigError, DataError
from verl.utils.tokenizer_protocol import Tokenizer

TRUNCATION = ("error", "drop", "truncate_left")
ON_BAD_ROW = ("error", "skip")
PathsLike = str | os.PathLike[str] | list[str | os.PathLike[str]]


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"data.{name}={value!r} is not allowed; use one of {', '.join(choices)}")


def _length(tokenizer: Tokenizer, kind: str, row: dict[str, Any], mode: str) -> int:
    """Tokens of the part max_prompt_length limits: the prompt (prompt/preference), the input (sft)."""
    if kind == "sft":
        if "messages" in row:
            msgs = row["messages"]
            last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            return len(encode_prompt(tokenizer, msgs[:last], mode, row)) if last else 0
        return len(encode_prompt(tokenizer, row["input"], mode, row))
    return len(encode_prompt(tokenizer, row["prompt"], mode, row))


def iter_rows(
    paths: PathsLike,
    kind: str,
    *,
    report: DataReport | None = None,
    fields: dict[str, str] | None = None,
    tokenizer: Tokenizer | None = None,
    max_prompt_length: int | None = None,
    truncation: str = "error",
    apply_chat_template: bool | str = True,
    purpose: str = "train",
) -> Iterator[dict[str, Any]]:
    """Yield the good canonical rows one by one, counting every other row in `report`.

    Rows longer than max_prompt_length are never yielded under truncation 'error' or 'drop' (they are
    counted as `too_long`); under 'truncate_left' they are yielded and counted as truncated. Unreadable
    files raise DataError. The report's token statistics are filled in when the iterator is exhausted.
    `purpose` picks a DatasetDict folder's split when the path does not name one (`verl.data.hf`).
    """
    report = report if report is not None else DataReport(kind)
    for _, row in _checked(_file_records(paths, kind, report, purpose), kind, report, fields, tokenizer,
                           max_prompt_length, truncation, apply_chat_template):
        yield row


def _file_records(paths: PathsLike, kind: str, report: DataReport, purpose: str) -> Iterator[Record]:
    check_kind(kind)
    files, ignored = expand_paths(paths, purpose)
    report.files.extend(files)
    report.ignored_files.extend(ignored)
    blank = [0]
    for file in files:
        yield from iter_records(file, report.notes, blank)
    report.blank_lines += blank[0]


def _dataset_records(dataset: Any, name: str, report: DataReport) -> Iterator[Record]:
    """The rows of a Python dataset (a `datasets.Dataset`, or anything with len() and rows by index),
    named `<name>` with their 0-based index."""
    report.files.append(name)
    batches = getattr(dataset, "iter", None)
    i = 0
    if callable(batches):  # a datasets.Dataset: columns a batch at a time, much faster than row by row
        for batch in batches(batch_size=1024):
            keys = list(batch)
            for values in zip(*(batch[k] for k in keys), strict=True):
                yield Record(name, i, value=dict(zip(keys, values, strict=True)), pos=i)
                i += 1
        return
    for i in range(len(dataset)):
        value = dataset[i]
        if isinstance(value, Mapping):
            yield Record(name, i, value=dict(value), pos=i)
        else:
            yield Record(name, i, error=("not_an_object", f"the row is a {type(value).__name__}, not a dict"),
                         pos=i)


def _checked(
    records: Iterator[Record],
    kind: str,
    report: DataReport,
    fields: dict[str, str] | None,
    tokenizer: Tokenizer | None,
    max_prompt_length: int | None,
    truncation: str,
    apply_chat_template: bool | str,
) -> Iterator[tuple[Record, dict[str, Any]]]:
    """Every record through the row checks: (record, canonical row) for the good ones, the rest in `report`."""
    check_kind(kind)
    _check_choice("truncation", truncation, TRUNCATION)
    mode = template_mode(apply_chat_template)
    norm = RowNormalizer(kind, fields)
    lengths = array("l")  # one int per row: stays small while millions of rows stream through
    truncated = dropped = 0
    for rec in records:
        report.total_rows += 1
        if rec.error is not None:
            report.add_issue(rec.error[0], None, rec.file, rec.line, rec.error[1])
            continue
        try:
            row, sources = norm.normalize(rec.value, images_base(rec.file))
        except RowError as e:
            report.add_issue(e.code, e.field, rec.file, rec.line, e.detail)
            continue
        row["line"], row["file"] = rec.line, rec.file
        if tokenizer is not None:
            n = _length(tokenizer, kind, row, mode)
            lengths.append(n)
            if max_prompt_length is not None and n > max_prompt_length:
                if truncation == "truncate_left":
                    truncated += 1
                else:
                    dropped += truncation == "drop"
                    report.add_issue(
                        "too_long",
                        None,
                        rec.file,
                        rec.line,
                        f"{n} prompt tokens > max_prompt_length={max_prompt_length}",
                    )
                    continue
        for fld, src in sources.items():
            report.add_mapping(fld, src)
        report.kept_rows += 1
        yield rec, row
    if tokenizer is not None:
        report.token_stats = TokenStats.from_lengths(
            lengths, max_prompt_length, truncation, truncated, dropped
        )


def _enforce(report: DataReport, kept: int, on_bad_row: str, truncation: str,
             max_prompt_length: int | None) -> None:
    """The row policy: no rows, bad rows under on_bad_row=error, too-long rows under truncation=error."""
    too_long = report.reasons.get("too_long")
    n_bad = report.dropped_rows - (too_long.count if too_long else 0)
    if not kept:
        raise DataError(
            f"no usable rows in {', '.join(report.files)}: every row was dropped or the file is empty.\n"
            f"{report.render()}"
        )
    if n_bad and on_bad_row == "error":
        raise DataError(
            f"{n_bad} of {report.total_rows} rows are bad (data.on_bad_row=error).\n{report.render()}\n"
            "Fix the rows, map your keys with data.fields.<field>=<key>, or set data.on_bad_row=skip to drop "
            "them (they stay counted in the report)."
        )
    if too_long and truncation == "error":
        raise DataError(
            f"{too_long.count} rows have prompts longer than max_prompt_length={max_prompt_length} "
            f"(data.truncation=error).\n{report.render()}"
        )


def load_rows(
    paths: PathsLike,
    kind: str,
    *,
    fields: dict[str, str] | None = None,
    on_bad_row: str = "error",
    tokenizer: Tokenizer | None = None,
    max_prompt_length: int | None = None,
    truncation: str = "error",
    apply_chat_template: bool | str = True,
    purpose: str = "train",
) -> tuple[list[dict[str, Any]], DataReport]:
    """All canonical rows of `paths` in memory, and the report; DataError when the row policy is violated.

    Raises when on_bad_row='error' and any row is bad, when truncation='error' and a prompt is too
    long, and always when no row survives -- a run must never start on an empty dataset. `index_rows`
    is the same with the rows left in their files.
    """
    _check_choice("on_bad_row", on_bad_row, ON_BAD_ROW)
    report = DataReport(kind)
    rows = [row for _, row in _checked(_file_records(paths, kind, report, purpose), kind, report, fields,
                                       tokenizer, max_prompt_length, truncation, apply_chat_template)]
    _enforce(report, len(rows), on_bad_row, truncation, max_prompt_length)
    return rows, report


def index_rows(
    paths: PathsLike,
    kind: str,
    *,
    fields: dict[str, str] | None = None,
    on_bad_row: str = "error",
    tokenizer: Tokenizer | None = None,
    max_prompt_length: int | None = None,
    truncation: str = "error",
    apply_chat_template: bool | str = True,
    purpose: str = "train",
) -> tuple[RowIndex, DataReport]:
    """`load_rows`, but the good rows stay in their files: a `RowIndex` reads them back on demand, so
    memory does not grow with the data (what the trainers use; see `verl.data.index`)."""
    _check_choice("on_bad_row", on_bad_row, ON_BAD_ROW)
    report = DataReport(kind)
    index = RowIndex(kind, fields)
    for rec, row in _checked(_file_records(paths, kind, report, purpose), kind, report, fields, tokenizer,
                             max_prompt_length, truncation, apply_chat_template):
        index.add(rec.file, rec.pos, rec.line, rec.value, row)
    _enforce(report, len(index.finish()), on_bad_row, truncation, max_prompt_length)
    return index, report


def index_dataset(
    dataset: Any,
    kind: str,
    *,
    name: str = "dataset",
    purpose: str = "train",
    fields: dict[str, str] | None = None,
    on_bad_row: str = "error",
    tokenizer: Tokenizer | None = None,
    max_prompt_length: int | None = None,
    truncation: str = "error",
    apply_chat_template: bool | str = True,
) -> tuple[RowIndex, DataReport]:
    """A Python `datasets.Dataset` / `DatasetDict` (duck-typed: `verl.data.hf`) through the same checks and
    report as files; a bad row is named `name[i]`. The rows are read from the object on demand."""
    _check_choice("on_bad_row", on_bad_row, ON_BAD_ROW)
    dataset, shown = hf.python_dataset(dataset, name, purpose)
    source = f"<{shown}>"
    report = DataReport(kind)
    index = RowIndex(kind, fields)
    index.add_dataset(source, dataset)
    for rec, row in _checked(_dataset_records(dataset, source, report), kind, report, fields, tokenizer,
                             max_prompt_length, truncation, apply_chat_template):
        index.add(rec.file, rec.pos, rec.line, rec.value, row)
    _enforce(report, len(index.finish()), on_bad_row, truncation, max_prompt_length)
    return index, report


def images_base(file: str) -> str | None:
    """The folder a row's relative image paths are resolved against: its data file's (None for a Python
    dataset, named `<...>`: the working directory)."""
    return None if file.startswith("<") else os.path.dirname(os.path.abspath(file))


def canonical_record(kind: str, row: dict[str, Any]) -> dict[str, Any]:
    """The JSONL form `verl data normalize` writes (no file/line bookkeeping); images as absolute paths or
    base64 data URIs, which read back as the same images."""
    if kind == "prompt":
        out = {
            "prompt": row["prompt"],
            "ground_truth": row["ground_truth"],
            "data_source": row["data_source"],
            "metadata": row["metadata"],
        }
    else:
        out = {k: v for k, v in row.items() if k not in ("file", "line", "images")}
    if row.get("images"):
        out["images"] = [images.to_json(ref) for ref in row["images"]]
    return out


def _json_default(v: Any) -> Any:
    # Parquet metadata can hold dates, decimals and bytes; write them as text rather than fail.
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return str(v)


def normalize_files(
    paths: PathsLike,
    out: str | os.PathLike[str],
    kind: str,
    *,
    fields: dict[str, str] | None = None,
    on_bad_row: str = "skip",
    tokenizer: Tokenizer | None = None,
    max_prompt_length: int | None = None,
    truncation: str = "error",
    apply_chat_template: bool | str = True,
) -> DataReport:
    """Stream `paths` into canonical UTF-8 JSONL at `out` (written atomically); returns the report.

    Never overwrites an input. With on_bad_row='error' nothing is written if any row is bad; with
    'skip' the good rows are written and the bad ones are in the report. Memory stays flat in the
    file size: one row at a time, plus the report's counters.
    """
    _check_choice("on_bad_row", on_bad_row, ON_BAD_ROW)
    out_path = Path(out)
    inputs, _ = expand_paths(paths)
    for p in inputs:
        if out_path.exists() and os.path.samefile(p, out_path) or out_path.resolve() == Path(p).resolve():
            raise DataError(f"output {out_path} is the input file {p}; normalize never overwrites its input")
    if out_path.is_dir():
        raise DataError(f"output {out_path} is a directory; give a file name like {out_path / 'data.jsonl'}")
    report = DataReport(kind)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    ok = False
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            for row in iter_rows(
                paths,
                kind,
                report=report,
                fields=fields,
                tokenizer=tokenizer,
                max_prompt_length=max_prompt_length,
                truncation=truncation,
                apply_chat_template=apply_chat_template,
            ):
                try:
                    line = json.dumps(canonical_record(kind, row), ensure_ascii=False, default=_json_default)
                    f.write(line.encode("utf-8"))
                except (UnicodeEncodeError, ValueError) as e:
                    report.kept_rows -= 1
                    report.add_issue(
                        "invalid_unicode", None, row["file"], row["line"], f"row cannot be written: {e}"
                    )
                    continue
                f.write(b"\n")
        ok = report.kept_rows > 0 and (on_bad_row == "skip" or report.is_clean)
        if ok:
            os.replace(tmp, out_path)
    finally:
        if not ok and os.path.exists(tmp):
            os.unlink(tmp)
    return report


__all__ = ["images_base", "iter_rows", "load_rows", "index_rows", "index_dataset", "normalize_files",
           "canonical_record", "TRUNCATION", "ON_BAD_ROW"]
