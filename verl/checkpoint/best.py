"""The best checkpoint of a run (`checkpoint.keep_best`): which one it is, and whether a new value beats it.

The record lives in ``<run_dir>/checkpoints/best.json`` ({step, metric, value, mode}), next to ``latest`` and
replaced atomically the same way; a step folder is never edited after its commit, so its manifest stays
valid. The manager writes the record when it commits the checkpoint that became best (so it never names a
folder that is not complete) and spares that folder from the ``save_total_limit`` rotation. The trainer also
keeps the record in each checkpoint's extra state, so a resume continues with the best as of that step.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from verl.checkpoint._fs import atomic_write_text

BEST_NAME = "best.json"


@dataclass(frozen=True)
class BestRecord:
    """Checkpoint `step` holds the best `value` of validation metric `metric` (largest or smallest: `mode`)."""

    step: int
    metric: str
    value: float
    mode: Literal["max", "min"] = "max"

    @property
    def folder(self) -> str:
        return f"step_{self.step}"

    def describe(self) -> str:
        return f"{self.metric}={self.value:.4g} ({self.mode})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> BestRecord | None:
        """The record in `data`, or None when it is missing or not one (an older or hand-edited file)."""
        try:
            mode = data["mode"]
            if mode not in ("max", "min"):
                return None
            return cls(int(data["step"]), str(data["metric"]), float(data["value"]), mode)
        except (KeyError, TypeError, ValueError):
            return None


def improves(value: float, best: BestRecord | None, mode: str) -> bool:
    """Whether `value` beats `best` (strictly: a tie keeps the older checkpoint); NaN never does."""
    if math.isnan(value):
        return False
    if best is None:
        return True
    return value > best.value if mode == "max" else value < best.value


def read_best(root: Path) -> BestRecord | None:
    """The record in ``<checkpoints>/best.json``, or None (absent or unreadable)."""
    try:
        return BestRecord.from_dict(json.loads((root / BEST_NAME).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def write_best(root: Path, record: BestRecord | None) -> None:
    """Replace ``best.json`` atomically with `record` (None removes it)."""
    path = root / BEST_NAME
    if record is None:
        path.unlink(missing_ok=True)
        return
    atomic_write_text(path, json.dumps(record.to_dict(), sort_keys=True) + "\n")


__all__ = ["BEST_NAME", "BestRecord", "improves", "read_best", "write_best"]
