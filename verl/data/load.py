"""Reading data files into canonical rows, with a report of every row that was not kept.

`iter_rows` streams (it is what `verl data normalize` uses on multi-GB files); `load_rows` is what the
trainer calls: it materialises the rows and turns the report into a DataError when the policy says so.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verl.data.chat import encode_prompt, template_mode
from verl.data.fields import RowError, RowNormalizer, check_kind
from verl.data.readers import expand_paths, iter_records
from verl.data.report import DataReport, TokenStats
from verl.errors import ConfigError, DataError

TRUNCATION = ("error", "drop", "truncate_left")
ON_BAD_ROW = ("error", "skip")
PathsLike = str | os.PathLike[str] | list[str | os.PathLike[str]]


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"data.{name}={value!r} is not allowed; use one of {', '.join(choices)}")


def _length(tokenizer: Any, kind: str, row: dict[str, Any], mode: str) -> int:
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
    tokenizer: Any = None,
    max_prompt_length: int | None = None,
    truncation: str = "error",
    apply_chat_template: bool | str = True,
) -> Iterator[dict[str, Any]]:
    """Yield the good canonical rows one by one, counting every other row in `report`.

    Rows longer than max_prompt_length are never yielded under truncation 'error' or 'drop' (they are
    counted as `too_long`); under 'truncate_left' they are yielded and counted as truncated. Unreadable
    files raise DataError. The report's token statistics are filled in when the iterator is exhausted.
    """
    check_kind(kind)
    _check_choice("truncation", truncation, TRUNCATION)
    mode = template_mode(apply_chat_template)
    norm = RowNormalizer(kind, fields)
    report = report if report is not None else DataReport(kind)
    files, ignored = expand_paths(paths)
    report.files.extend(files)
    report.ignored_files.extend(ignored)
    lengths: list[int] = []
    truncated = dropped = 0
    blank = [0]
    for file in files:
        for rec in iter_records(file, report.notes, blank):
            report.total_rows += 1
            if rec.error is not None:
                report.add_issue(rec.error[0], None, rec.file, rec.line, rec.error[1])
                continue
            try:
                row, sources = norm.normalize(rec.value)
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
            yield row
    report.blank_lines += blank[0]
    if tokenizer is not None:
        report.token_stats = TokenStats.from_lengths(
            lengths, max_prompt_length, truncation, truncated, dropped
        )


def load_rows(
    paths: PathsLike,
    kind: str,
    *,
    fields: dict[str, str] | None = None,
    on_bad_row: str = "error",
    tokenizer: Any = None,
    max_prompt_length: int | None = None,
    truncation: str = "error",
    apply_chat_template: bool | str = True,
) -> tuple[list[dict[str, Any]], DataReport]:
    """All canonical rows of `paths` and the report; DataError when the row policy is violated.

    Raises when on_bad_row='error' and any row is bad, when truncation='error' and a prompt is too
    long, and always when no row survives -- a run must never start on an empty dataset.
    """
    _check_choice("on_bad_row", on_bad_row, ON_BAD_ROW)
    report = DataReport(kind)
    rows = list(
        iter_rows(
            paths,
            kind,
            report=report,
            fields=fields,
            tokenizer=tokenizer,
            max_prompt_length=max_prompt_length,
            truncation=truncation,
            apply_chat_template=apply_chat_template,
        )
    )
    too_long = report.reasons.get("too_long")
    n_bad = report.dropped_rows - (too_long.count if too_long else 0)
    if not rows:
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
    return rows, report


def canonical_record(kind: str, row: dict[str, Any]) -> dict[str, Any]:
    """The JSONL form `verl data normalize` writes (no file/line bookkeeping)."""
    if kind == "prompt":
        return {
            "prompt": row["prompt"],
            "ground_truth": row["ground_truth"],
            "data_source": row["data_source"],
            "metadata": row["metadata"],
        }
    return {k: v for k, v in row.items() if k not in ("file", "line")}


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
    tokenizer: Any = None,
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


__all__ = ["iter_rows", "load_rows", "normalize_files", "canonical_record", "TRUNCATION", "ON_BAD_ROW"]
