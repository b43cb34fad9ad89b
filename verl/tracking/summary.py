"""The lines a training run ends with: steps and wall time, the best validation and its step, the last
validation's metrics, the last checkpoint, where the metrics, samples and plot are, and the commands to run
next (`verl eval RUN_DIR`, `verl plot RUN_DIR`). The plot is `verl plot`'s: the SVG always, the PNG when
matplotlib is installed (otherwise the summary says so and how to install it).
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from verl.errors import VerlError
from verl.tracking.console import format_duration, format_value

# Without checkpoint.keep_best, the validation metric the summary calls best, and which way is better.
DEFAULT_BEST = (("val/score", "max"), ("val/accuracy", "max"), ("val/loss", "min"))


def best_validation(history: Sequence[Mapping[str, Any]], metric: str | None = None,
                    mode: str = "max") -> tuple[str, float, int] | None:
    """(metric, value, step) of the best validation in `history`: of `metric` (the keep_best one) or of the
    first of `DEFAULT_BEST` the run logged; the earliest step wins a tie. None when nothing was validated."""
    choices = [(metric, mode)] if metric else list(DEFAULT_BEST)
    for key, way in choices:
        found = [(float(row[key]), int(row["step"])) for row in history
                 if isinstance(row.get(key), (int, float)) and math.isfinite(float(row[key]))]
        if found:
            sign = 1.0 if way == "max" else -1.0
            value, step = max(found, key=lambda vs: (sign * vs[0], -vs[1]))
            return key, value, step
    return None


def last_validation(history: Sequence[Mapping[str, Any]]) -> tuple[int, dict[str, float]] | None:
    """(step, val/* metrics) of the last row that has validation metrics."""
    for row in reversed(history):
        metrics = {k: float(v) for k, v in row.items() if k.startswith("val/") and isinstance(v, (int, float))}
        if metrics:
            return int(row["step"]), metrics
    return None


def write_plot(run_dir: Path) -> list[str]:
    """`verl plot RUN_DIR`'s files for this run; the lines that name them (or say why there is none)."""
    from verl.tracking.plot import PLOT_INSTALL_HINT, plot_run, write_png

    if not (run_dir / "metrics.jsonl").is_file():
        return ["plot: none (no metrics.jsonl: logging.backends has no jsonl)"]
    try:
        svg, charts = plot_run(run_dir)
    except VerlError as exc:  # e.g. none of the default metrics was logged
        return [f"plot: none ({exc})"]
    if find_spec("matplotlib") is None:
        return [f"plot: {svg} (no PNG: matplotlib is not installed; {PLOT_INSTALL_HINT})"]
    try:
        png = write_png(charts, str(run_dir), run_dir / "metrics.png")
    except Exception as exc:  # noqa: BLE001  (a plot never fails a run that trained)
        return [f"plot: {svg} (no PNG: {exc})"]
    return [f"plot: {png} and {svg}"]


def run_summary_lines(trainer: Any, keep_best: Any, checkpoint: Path | None, seconds: float) -> list[str]:
    """The end-of-run summary of `trainer` (a `verl.trainer.compose.loop.Trainer`) after `loop.fit`: `keep_best` (a
    `KeepBest` or None), the newest checkpoint, and the wall time of this `fit`."""
    cfg, run_dir, history = trainer.config, Path(trainer.run_dir), trainer.history
    lines = [f"run summary: {cfg.trainer.kind}, step {trainer.step_count}/{cfg.trainer.total_steps}, "
             f"wall time {format_duration(seconds)}"]
    record = getattr(keep_best, "record", None)
    if record is not None:
        lines.append(f"  best validation: {record.metric}={format_value(record.metric, record.value)} at step "
                     f"{record.step} (checkpoint.keep_best, {record.mode})")
    else:
        best = best_validation(history, getattr(keep_best, "metric", None), getattr(keep_best, "mode", "max"))
        if best is not None:
            key, value, step = best
            lines.append(f"  best validation: {key}={format_value(key, value)} at step {step}")
        else:
            lines.append("  best validation: none (no validation ran: trainer.val_every, validation rows)")
    last = last_validation(history)
    if last is not None:
        fields = "  ".join(f"{k}={format_value(k, v)}" for k, v in sorted(last[1].items()))
        lines.append(f"  last validation (step {last[0]}): {fields}")
    lines.append(f"  last checkpoint: {checkpoint if checkpoint is not None else 'none (checkpoint.save_interval)'}")
    lines.append(f"  run directory: {run_dir}")
    for name, what in (("metrics.jsonl", "metrics"), ("samples.jsonl", "samples")):
        if (run_dir / name).is_file():
            lines.append(f"  {what}: {run_dir / name}")
    lines += [f"  {line}" for line in write_plot(run_dir)]
    where = shlex.quote(str(run_dir))
    nxt = [f"verl view {where}", f"verl plot {where}"]
    if cfg.trainer.kind != "rm" and checkpoint is not None:  # a reward model is not sampled from
        nxt.insert(0, f"verl eval {where}")
    lines.append("  next: " + "   ".join(nxt))
    return lines


__all__ = ["DEFAULT_BEST", "best_validation", "last_validation", "run_summary_lines", "write_plot"]
