"""A run's `metrics.jsonl` as it grows, and which validation step was best.

Only the current `metrics.jsonl` is read: `metrics.jsonl.1`, `.2`, ... are earlier runs in the same folder
(moved aside by a fresh start) and would mix two runs in one curve. Values that are not finite numbers become
None (a gap in the chart), since the page's JSON cannot hold NaN.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

from verl.view.tail import JsonlTail, Line, TailIndex
from verl.view.values import as_int, num

FALLBACK_BEST = ("val/accuracy", "val/score")  # without checkpoints/best.json: the largest of the first found
BEST_FILE = Path("checkpoints") / "best.json"  # written by verl.checkpoint.best (not imported: it loads torch)


def clean_metrics_row(row: dict[str, Any]) -> dict[str, Any] | None:
    """`{"step": int, name: float | None}`, or None for a row without an integer step."""
    step = as_int(row.get("step"))
    if step is None:
        return None
    out: dict[str, Any] = {"step": step}
    for key, value in row.items():
        if key == "step" or isinstance(value, (str, bool, dict, list)) or value is None:
            continue
        if isinstance(value, (int, float)):
            out[str(key)] = num(value)
    return out


def read_best_file(run_dir: Path) -> dict[str, Any] | None:
    """The run's best checkpoint record ({step, metric, value, mode}), or None when absent or not one."""
    try:
        data = json.loads((run_dir / BEST_FILE).read_text(encoding="utf-8"))
        step, metric, value = as_int(data["step"]), str(data["metric"]), float(data["value"])
        mode = data.get("mode", "max")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if step is None or mode not in ("max", "min"):
        return None
    return {"step": step, "metric": metric, "value": num(value), "mode": mode, "source": "checkpoints/best.json"}


class MetricsLog(TailIndex):
    """The rows of one run's metrics.jsonl read so far; `refresh()` reads what was appended."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.tail = JsonlTail(self.run_dir / "metrics.jsonl")
        self.lock = threading.Lock()
        self._clear()

    def _clear(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.keys: dict[str, None] = {}  # every metric name seen, in first-seen order
        self._best: dict[str, tuple[float, int]] = {}  # fallback key -> (largest value, its step)

    def _add(self, line: Line) -> None:
        row = clean_metrics_row(line.row)
        if row is None:
            self.tail.bad_lines += 1
            return
        self.rows.append(row)
        for key, value in row.items():
            if key != "step":
                self.keys.setdefault(key)
            if key in FALLBACK_BEST and value is not None and value > self._best.get(key, (-math.inf, 0))[0]:
                self._best[key] = (value, row["step"])

    def best(self) -> dict[str, Any] | None:
        """checkpoints/best.json when the run keeps one, else the step of the largest val/accuracy or val/score."""
        record = read_best_file(self.run_dir)
        if record is not None:
            return record
        for key in FALLBACK_BEST:
            if key in self._best:
                value, step = self._best[key]
                return {"step": step, "metric": key, "value": value, "mode": "max", "source": f"largest {key}"}
        return None

    def since(self, start: int) -> dict[str, Any]:
        """The rows from index `start` on; `generation` changes when the file was replaced (start over)."""
        with self.lock:
            start = max(0, start)
            return {"generation": self.tail.generation, "start": start, "rows": self.rows[start:],
                    "count": len(self.rows), "best": self.best(), "bad_lines": self.tail.bad_lines,
                    "problems": list(self.tail.problems)}


def downsample(rows: list[dict[str, Any]], max_points: int) -> tuple[list[dict[str, Any]], int]:
    """At most about `max_points` rows: every k-th (the last always), plus the validation rows while they fit
    (they are sparse and mark the best step). Returns the rows and k (1: nothing dropped)."""
    if len(rows) <= max_points:
        return rows, 1
    every = math.ceil(len(rows) / max_points)
    val_rows = sum(1 for r in rows if any(k.startswith("val/") for k in r))
    keep_val = val_rows <= max_points
    kept = [r for i, r in enumerate(rows)
            if i % every == 0 or i == len(rows) - 1 or (keep_val and any(k.startswith("val/") for k in r))]
    return kept, every


__all__ = ["MetricsLog", "clean_metrics_row", "downsample", "read_best_file"]
