"""The data report: every row read is either kept or counted here with its line and reason.

The report is the contract that nothing is dropped silently. It holds only counters, the first few
examples per reason and (optionally) one int per row for token lengths, so it stays small while a
multi-gigabyte file streams through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_EXAMPLES = 20

# What to do about each reason; the field name (if any) is substituted for {field}.
HINTS: dict[str, str] = {
    "malformed_json": "fix the JSON on that line (a .jsonl file holds one complete object per line)",
    "not_utf8": "re-save the file as UTF-8 (e.g. `iconv -f cp1252 -t utf-8`)",
    "not_an_object": 'each row must be a JSON object like {"{field}": ...}',
    "csv_columns": "the row has a different number of cells than the header; check quoting of commas/newlines",
    "duplicate_key": "the same key appears twice in one object; keep one",
    "duplicate_field": ("two keys resolve to '{field}'; pick one with data.fields.{field}=<key> "
                        "(verl data: --map {field}=<key>)"),
    "missing": ("add '{field}' to every row, or map your key to it: data.fields.{field}=<key> "
                "(verl data: --map {field}=<key>)"),
    "null": "give '{field}' a value, or set data.on_bad_row=skip to drop these rows",
    "wrong_type": "'{field}' must be a string (or chat messages where allowed); convert the column",
    "empty": "'{field}' is empty or whitespace only; fill it in or set data.on_bad_row=skip",
    "bad_messages": '\'{field}\' must be a non-empty list of {"role": str, "content": str} objects',
    "no_assistant_turn": "a conversation for SFT needs at least one non-empty assistant message",
    "invalid_unicode": "'{field}' holds an unpaired UTF-16 surrogate (\\ud800-\\udfff escape); remove it",
    "same_answer": "a preference pair needs two different answers; fix the rejected one or drop the row",
    "bad_margin": "'margin' must be a finite number (how much the chosen answer should win by); fix or remove it",
    "too_long": "raise data.max_prompt_length, or set data.truncation=drop or truncate_left",
    # rows with images (verl.data.images)
    "wrong_type: images": ("'images' is a list of file paths, bytes, {'bytes': ..., 'path': ...} dicts or PIL images "
                           "(one value is a list of one)"),
    "image_count": ("write one <image> per image where it goes in the prompt (or none: the images then go before the "
                    "first user turn); an image part {'type': 'image'} counts as one"),
    "image_missing": "the image file is not there: relative paths are resolved against the data file's folder",
    "image_not_a_file": "an image path must name an image file, not a folder or a device",
    "bad_image": "the image cannot be read (empty, truncated, not an image, a URL); re-export it or drop the row",
    "image_too_large": "the image declares more pixels than the decompression-bomb limit; shrink it or drop the row",
}


class RowError(Exception):
    """Internal: one row is bad for `code` (on `field`); never escapes the data package (the report counts it)."""

    def __init__(self, code: str, field: str | None, detail: str) -> None:
        super().__init__(detail)
        self.code, self.field, self.detail = code, field, detail


@dataclass
class ReasonStats:
    """Count and the first few (file, line, detail) examples of one reason."""

    count: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    hint: str = ""


@dataclass
class TokenStats:
    """Prompt token-length statistics; percentiles use the nearest-rank definition."""

    count: int
    min: int
    median: float
    p95: int
    max: int
    limit: int | None
    over_limit: int
    truncation: str
    truncated: int
    dropped: int

    @classmethod
    def from_lengths(
        cls, lengths: Any, limit: int | None, truncation: str, truncated: int, dropped: int
    ) -> TokenStats | None:
        if not len(lengths):
            return None
        s = np.sort(np.asarray(lengths, dtype=np.int64))  # a compact array: millions of rows stream through
        n = len(s)
        median = float(s[n // 2]) if n % 2 else (int(s[n // 2 - 1]) + int(s[n // 2])) / 2.0
        p95 = int(s[max(0, math.ceil(0.95 * n) - 1)])
        over = int((s > limit).sum()) if limit is not None else 0
        return cls(n, int(s[0]), median, p95, int(s[-1]), limit, over, truncation, truncated, dropped)


def location(file: str, line: int) -> str:
    """`file:line` for text formats, `file row N` for Parquet and Arrow (which have no lines), `dataset[i]`
    for a Python dataset (its rows are named `<dataset>` with their 0-based index, as `dataset[i]` reads them)."""
    if file.startswith("<") and file.endswith(">"):
        return f"{file[1:-1]}[{line}]"
    if file.endswith((".parquet", ".arrow")):
        return f"{file} row {line}"
    return f"{file}:{line}"


@dataclass
class DataReport:
    """What happened to every row of one or more data files."""

    kind: str
    files: list[str] = field(default_factory=list)
    total_rows: int = 0
    kept_rows: int = 0
    reasons: dict[str, ReasonStats] = field(default_factory=dict)
    field_mapping: dict[str, dict[str, int]] = field(default_factory=dict)
    blank_lines: int = 0
    ignored_files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    token_stats: TokenStats | None = None

    def add_issue(self, code: str, fld: str | None, file: str, line: int, detail: str) -> None:
        """Count one row against a reason (the row itself is dropped by the caller)."""
        key = f"{code}: {fld}" if fld else code
        stats = self.reasons.get(key)
        if stats is None:
            stats = ReasonStats(hint=HINTS.get(key, HINTS.get(code, "")).replace("{field}", fld or "prompt"))
            self.reasons[key] = stats
        stats.count += 1
        if len(stats.examples) < MAX_EXAMPLES:
            stats.examples.append({"file": file, "line": line, "detail": detail})

    def add_mapping(self, fld: str, source: str) -> None:
        counts = self.field_mapping.setdefault(fld, {})
        counts[source] = counts.get(source, 0) + 1

    @property
    def dropped_rows(self) -> int:
        """Rows read but not kept, for any reason."""
        return self.total_rows - self.kept_rows

    @property
    def is_clean(self) -> bool:
        """True when at least one row was read and every row was kept."""
        return self.total_rows > 0 and self.kept_rows == self.total_rows

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able form, for `verl data ... --json` and the normalize side file."""
        return {
            "kind": self.kind,
            "files": list(self.files),
            "total_rows": self.total_rows,
            "kept_rows": self.kept_rows,
            "dropped_rows": self.dropped_rows,
            "clean": self.is_clean,
            "reasons": {
                k: {"count": v.count, "hint": v.hint, "examples": list(v.examples)}
                for k, v in self.reasons.items()
            },
            "field_mapping": {k: dict(v) for k, v in self.field_mapping.items()},
            "blank_lines": self.blank_lines,
            "ignored_files": list(self.ignored_files),
            "notes": list(self.notes),
            "token_stats": None if self.token_stats is None else dict(self.token_stats.__dict__),
        }

    def render(self, max_lines_per_reason: int = 5) -> str:
        """Human-readable text, embedded in DataError messages and printed by the CLI without rich."""
        out = [
            f"data report ({self.kind}): {self.total_rows} rows read, {self.kept_rows} kept, "
            f"{self.dropped_rows} dropped; files: {', '.join(self.files) or '(none)'}"
        ]
        if self.field_mapping:
            parts = []
            for fld, srcs in self.field_mapping.items():
                parts.append(f"{fld} <- " + ", ".join(f"{s!r} ({n} rows)" for s, n in srcs.items()))
            out.append("field mapping: " + "; ".join(parts))
        for key, st in sorted(self.reasons.items(), key=lambda kv: -kv[1].count):
            lines = ", ".join(str(e["line"]) for e in st.examples)
            out.append(
                f"  {key}: {st.count} rows (lines {lines}{', ...' if st.count > len(st.examples) else ''})"
            )
            for e in st.examples[:max_lines_per_reason]:
                out.append(f"    {location(e['file'], e['line'])}: {e['detail']}")
            if st.hint:
                out.append(f"    fix: {st.hint}")
        if self.total_rows == 0:
            out.append("  no rows at all: the file(s) are empty or hold only blank lines")
        if self.blank_lines:
            out.append(f"blank lines skipped: {self.blank_lines}")
        if self.ignored_files:
            out.append("ignored files (unsupported extension): " + ", ".join(self.ignored_files))
        out.extend(f"note: {n}" for n in self.notes)
        ts = self.token_stats
        if ts is not None:
            out.append(
                f"prompt tokens: min {ts.min}, median {ts.median:g}, p95 {ts.p95}, max {ts.max}"
                + (
                    f"; {ts.over_limit} over max_prompt_length={ts.limit} (truncation={ts.truncation}: "
                    f"{ts.truncated} truncated, {ts.dropped} dropped)"
                    if ts.limit is not None
                    else ""
                )
            )
        return "\n".join(out)


class GroundTruthGaps:
    """Prompt rows without a ground truth in a dataset where other rows have one: a reward that reads
    `ground_truth` would score them against nothing, so they are bad rows (`missing: ground_truth`). A dataset
    where no row has one is left alone (its reward reads none) unless `required` (the reward is known to read
    one: `verl data check --require-ground-truth`). Keeps a count and the first examples only."""

    def __init__(self, required: bool = False) -> None:
        self.required = required
        self.with_truth = 0
        self.count = 0
        self.examples: list[tuple[str, int]] = []

    def add(self, row: dict[str, Any]) -> None:
        """One kept canonical row."""
        if row.get("ground_truth") is not None:
            self.with_truth += 1
            return
        self.count += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append((row.get("file", "?"), row.get("line", 0)))

    def report(self, report: DataReport) -> None:
        """Move the rows without one from kept to bad in `report` (when some other row has one)."""
        if not self.count or not (self.with_truth or self.required):
            return
        why = (f"though {self.with_truth} other rows have one" if self.with_truth else
               "and --require-ground-truth says the reward reads one")
        detail = (f"no ground truth, {why}: a reward function that reads ground_truth would score this row "
                  "against nothing")
        for file, line in self.examples:
            report.add_issue("missing", "ground_truth", file, line, detail)
        report.reasons["missing: ground_truth"].count += self.count - len(self.examples)
        report.kept_rows -= self.count


__all__ = ["RowError", "DataReport", "GroundTruthGaps", "ReasonStats", "TokenStats", "HINTS", "MAX_EXAMPLES",
           "location"]
