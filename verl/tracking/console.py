"""What a training run prints: a start-up banner, a progress bar or one line per logged step, samples.

Two shapes, chosen by where stdout goes. On a terminal: a rich progress bar with an ETA, and above it one
metrics line per logged step cut to the terminal's width (fields that do not fit are left out, never
wrapped). Piped to a file or a log collector: no bar and no colour, one unwrapped line per logged step with
full metric names, so `grep`/`awk` see one record per line. User text (prompts, responses, paths) is
printed as plain text, never read as rich markup.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn
from rich.text import Text

# The metrics a step line shows, most important first; on a narrow terminal the tail is left out. Every other
# validation metric (`val/...`: SFT's loss, DPO's and RM's margins) follows them.
CONSOLE_KEYS = (
    "reward/mean", "val/accuracy", "val/score", "val/loss", "reward/accuracy", "loss", "accuracy", "train/accuracy",
    "eval/loss",
    "actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/vf_loss", "critic/explained_var",
    "actor/clipfrac", "actor/grad_norm", "response/length_mean", "timing/step", "perf/tokens_per_s",
)
# How many validation samples the console shows (all `trainer.log_samples` of them go to samples.jsonl).
CONSOLE_SAMPLES = 3


def format_duration(seconds: float) -> str:
    """`0:04:05`, `23:59:59`, and past a day `1d 02:03:04` (a 30-hour ETA is not `30:00:00`)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_points(delta: float) -> str:
    """A difference of two rates in percentage points: 0.25 -> `+25.0 pts` (not `+25.0%`, a ratio)."""
    return f"{delta * 100:+.1f} pts"


def format_value(key: str, value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if key.startswith("timing/"):
        return f"{value:.3g}s"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.2e}"
    if float(value).is_integer() and abs(value) < 1e5:
        return str(int(value))
    return f"{value:.4g}"


def metric_fields(metrics: Mapping[str, float], first: Sequence[str] = ()) -> list[str]:
    """`name=value` for `first` (e.g. the keep_best metric), the console's keys, then the other validation
    metrics present in `metrics`, most important first."""
    rest = sorted(k for k in metrics if k.startswith("val/"))
    keys = list(dict.fromkeys([*first, *CONSOLE_KEYS, *rest]))
    return [f"{k}={format_value(k, float(metrics[k]))}" for k in keys if metrics.get(k) is not None]


def step_line(step: int, total: int | None, eta: str, metrics: Mapping[str, float], width: int | None = None,
              label: str = "step", first: Sequence[str] = ()) -> str:
    """`step 3/30  eta 0:00:12  reward/mean=0.25  ...`; with `width`, only the fields that fit in it."""
    head = f"{label} {step}/{total}" if total else f"{label} {step}"
    line = f"{head}  eta {eta}"
    for field in metric_fields(metrics, first):
        candidate = f"{line}  {field}"
        if width is not None and len(candidate) > width:
            break
        line = candidate
    return line


def one_line(value: Any, limit: int | None = None) -> str:
    """A prompt/response/ground truth as one quoted line (newlines escaped), cut to `limit` characters."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    quoted = json.dumps(text, ensure_ascii=False)
    if limit is not None and len(quoted) > limit:
        quoted = quoted[: max(limit - 2, 1)] + "…\""
    return quoted


class _EtaColumn(ProgressColumn):
    """`eta 1d 02:03:04`: rich's own column counts hours past 24 instead of days."""

    def __init__(self, reporter: ConsoleReporter) -> None:
        super().__init__()
        self.reporter = reporter

    def render(self, task: Task) -> Text:
        return Text(f"eta {self.reporter.eta(int(task.completed))}")


class ConsoleReporter:
    """The console side of a run (or of a phase such as the demo's warm start, with its own `label`).
    `tty=None` asks whether stdout is a terminal; `enabled=False` prints nothing (ranks other than 0)."""

    def __init__(self, total_steps: int | None, *, start_step: int = 0, file: IO[str] | None = None,
                 tty: bool | None = None, label: str = "step", enabled: bool = True) -> None:
        self.total_steps = total_steps
        self.label = label
        self.enabled = enabled
        self.start_step = start_step
        self._start = time.monotonic()
        stream = file if file is not None else sys.stdout
        self.tty = bool(tty if tty is not None else getattr(stream, "isatty", lambda: False)())
        # Piped: no colour, no wrapping at a made-up 80 columns. On a terminal: its real width.
        self.console = Console(file=stream, force_terminal=self.tty, no_color=not self.tty, soft_wrap=not self.tty,
                               highlight=False, emoji=False)
        self.progress: Progress | None = None
        self._task = None
        self.first_keys: tuple[str, ...] = ()  # shown first on a step line (the keep_best metric)

    # ------------------------------------------------------------------ timing
    def eta(self, step: int) -> str:
        done = step - self.start_step
        if not self.total_steps or done <= 0:
            return "?"
        return format_duration((time.monotonic() - self._start) / done * (self.total_steps - step))

    # ------------------------------------------------------------------ output
    def print(self, text: str, fit: bool = False) -> None:
        """Plain text (never markup). `fit=True` (metrics and sample lines) cuts it to a terminal's width;
        otherwise (banner, paths) it is printed whole and the terminal wraps it."""
        if not self.enabled:
            return
        if self.tty and fit:
            self.console.print(Text(text), no_wrap=True, overflow="ellipsis", crop=True)
        else:
            self.console.print(Text(text), soft_wrap=True)

    def start(self, step: int) -> None:
        """Show the progress bar (terminal only), starting at `step` (a resumed run starts part-way)."""
        self.start_step = step
        self._start = time.monotonic()
        if not self.tty or not self.total_steps or not self.enabled:
            return
        self.progress = Progress(TextColumn(self.label.replace("[", "\\[") + " {task.completed}/{task.total}"),
                                 BarColumn(),
                                 TextColumn("{task.percentage:>3.0f}%"), _EtaColumn(self),
                                 console=self.console, transient=False, refresh_per_second=4)
        self._task = self.progress.add_task("train", total=self.total_steps, completed=step)
        self.progress.start()

    def advance(self, step: int) -> None:
        if self.progress is not None:
            self.progress.update(self._task, completed=step)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        width = self.console.width if self.tty else None
        self.print(step_line(step, self.total_steps, self.eta(step), metrics, width, self.label, self.first_keys),
                   fit=True)

    def samples(self, step: int, rows: Sequence[Mapping[str, Any]], path: str | None = None) -> None:
        shown = list(rows)[:CONSOLE_SAMPLES]
        if not shown:
            return
        where = f"; all {len(rows)} in {path}" if path else ""
        self.print(f"validation samples at step {step} ({len(shown)} of {len(rows)}{where}):")
        limit = max(self.console.width // 2 - 10, 20) if self.tty else None
        for row in shown:
            score = row.get("score")
            score_text = format_value("score", float(score)) if isinstance(score, (int, float)) else str(score)
            self.print(f"  prompt={one_line(row.get('prompt'), limit)}  response={one_line(row.get('response'), limit)}"
                       f"  score={score_text}  ground_truth={one_line(row.get('ground_truth'), limit)}", fit=True)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


__all__ = ["CONSOLE_KEYS", "ConsoleReporter", "format_duration", "format_points", "format_value", "metric_fields",
           "one_line", "step_line"]
