"""`verl view --out report.html`: the four views in one file that opens without a network or a server.

A report of a long run must stay a file a browser opens: the metrics are thinned to about `max_points` rows
per run, and samples, rollouts and tokens keep only their last `last_steps` steps (each cut says so on the
page). The data are the live API's answers, so the page shows the same thing either way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl.errors import ViewError
from verl.view.metrics import downsample
from verl.view.page import render_page
from verl.view.rows import RowIndex
from verl.view.runs import Run, Runs

MAX_ROWS_PER_FILE = 20_000  # rows of one samples/rollouts file in a report
MAX_TOKEN_ROWS = 400  # responses of tokens.jsonl in a report


def _index_fully(index) -> None:
    while True:
        before = index.tail.offset
        index.refresh()
        if index.tail.offset == before:
            return


def _rows(run: Run, index: RowIndex, last_steps: int, notes: list[str]) -> list[dict[str, Any]]:
    _index_fully(index)
    steps = sorted(index.by_step)
    kept_steps = steps[-last_steps:] if last_steps > 0 else steps
    ids = sorted(i for s in kept_steps for i in index.by_step[s])
    if len(ids) > MAX_ROWS_PER_FILE:
        ids = ids[-MAX_ROWS_PER_FILE:]
        notes.append(f"{run.name}: {index.path.name} cut to its last {MAX_ROWS_PER_FILE} rows (of {len(index)})")
    elif len(kept_steps) < len(steps):
        notes.append(f"{run.name}: {index.path.name} holds {len(steps)} steps; this report keeps the last "
                     f"{len(kept_steps)} ({len(ids)} of {len(index)} rows). `verl view` on the folder shows all")
    return index.read(ids)


def _tokens(run: Run, last_steps: int, notes: list[str]) -> list[dict[str, Any]]:
    _index_fully(run.tokens)
    steps = sorted(run.tokens.by_step)
    kept = steps[-last_steps:] if last_steps > 0 else steps
    ids = sorted(i for s in kept for i in run.tokens.by_step[s])[-MAX_TOKEN_ROWS:]
    if len(ids) < len(run.tokens.entries):
        notes.append(f"{run.name}: tokens.jsonl holds {len(run.tokens.entries)} responses over {len(steps)} steps; "
                     f"this report keeps the last {len(ids)}")
    return [run.tokens.get(i) for i in ids]


def report_data(runs: Runs, *, last_steps: int = 20, max_points: int = 2000) -> dict[str, Any]:
    """What the report embeds: per run its (thinned) metrics, last steps of rows and tokens, and notes."""
    notes: list[str] = []
    data: dict[str, Any] = {"runs": runs.answer("runs", {})["runs"], "metrics": {}, "rows": {}, "tokens": {},
                            "notes": notes}
    for run in runs.runs:
        _index_fully(run.metrics)
        metrics = run.metrics.since(0)
        rows, every = downsample(metrics["rows"], max_points)
        if every > 1:
            notes.append(f"{run.name}: metrics thinned to every {every}th step of {metrics['count']} rows "
                         "(validation rows kept); `verl view` on the folder shows every step")
        data["metrics"][run.number] = {**metrics, "rows": rows}
        data["rows"][run.number] = {kind: _rows(run, index, last_steps, notes) for kind, index in run.rows.items()}
        data["tokens"][run.number] = _tokens(run, last_steps, notes)
        for label, tail in [("metrics.jsonl", run.metrics.tail), *((i.path.name, i.tail) for i in run.rows.values()),
                            ("tokens.jsonl", run.tokens.tail)]:
            if tail.bad_lines:
                notes.append(f"{run.name}: {tail.bad_lines} unreadable line(s) in {label} skipped; first: "
                             f"{tail.problems[0] if tail.problems else '?'}")
    return data


def write_report(runs: Runs, out: str | Path, *, last_steps: int = 20, max_points: int = 2000) -> Path:
    """Write the self-contained report to `out`; returns its path."""
    out = Path(out)
    page = render_page(title=f"verl view: {', '.join(r.name for r in runs.runs)}",
                       data=report_data(runs, last_steps=last_steps, max_points=max_points))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise ViewError(f"could not write the report to {out}: {exc}. Fix: choose a writable path for --out") from exc
    return out


__all__ = ["report_data", "write_report"]
