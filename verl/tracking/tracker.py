"""One `Tracker.log(metrics, step)` fans out to every configured backend.

Console and JSONL are always available; TensorBoard and wandb are optional extras that fail at start-up
with an install hint, not halfway through a run.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from verl.errors import ConfigError, install_hint

KNOWN_BACKENDS = ("console", "jsonl", "tensorboard", "wandb")
# What the one-line console summary shows, in this order, when present.
CONSOLE_KEYS = (
    "reward/mean", "reward/accuracy", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/clipfrac",
    "critic/vf_loss", "critic/explained_var", "actor/grad_norm", "response/length_mean", "val/score",
    "loss", "accuracy", "timing/step", "perf/tokens_per_s",
)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a run's metrics.jsonl (for plots, tests and resume)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _format(value: float) -> str:
    if isinstance(value, float) and (abs(value) >= 1e4 or (0 < abs(value) < 1e-3)):
        return f"{value:.2e}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class Tracker:
    def __init__(
        self,
        backends: Iterable[str],
        run_dir: str | Path,
        *,
        config: Mapping[str, Any] | None = None,
        total_steps: int | None = None,
        project: str = "verl",
        experiment: str | None = None,
        enabled: bool = True,
        resume_step: int = 0,
    ) -> None:
        self.backends = list(dict.fromkeys(backends))
        unknown = [b for b in self.backends if b not in KNOWN_BACKENDS]
        if unknown:
            raise ConfigError(f"logging.backends: unknown backend(s) {unknown}; choose from {list(KNOWN_BACKENDS)}")
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self._start = time.monotonic()
        self._first_step = resume_step
        self._jsonl = self._tb = self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if "jsonl" in self.backends:
            self._jsonl = (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        if "tensorboard" in self.backends:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ConfigError(
                    "logging.backends has 'tensorboard' but it is not installed. Fix: "
                    f"{install_hint('tensorboard', 'tensorboard')}, or remove it from logging.backends"
                ) from exc
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if "wandb" in self.backends:
            try:
                import wandb
            except ImportError as exc:
                raise ConfigError("logging.backends has 'wandb' but it is not installed. Fix: "
                                  f"{install_hint('wandb', 'wandb')}, or remove it from logging.backends") from exc
            self._wandb = wandb.init(project=project, name=experiment, config=dict(config or {}),
                                     dir=str(self.run_dir))
        if "console" in self.backends:
            from rich.console import Console

            self.console = Console()

    def truncate_after(self, step: int) -> None:
        """Drop metrics rows past `step` (written by a run that crashed after its last checkpoint)."""
        if self._jsonl is None:
            return
        path = self.run_dir / "metrics.jsonl"
        self._jsonl.close()
        kept = [row for row in read_metrics(path) if row.get("step", 0) <= step]
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept), encoding="utf-8")
        tmp.replace(path)
        self._jsonl = path.open("a", encoding="utf-8")

    def eta(self, step: int) -> str:
        done = step - self._first_step
        if not self.total_steps or done <= 0:
            return "?"
        remaining = (time.monotonic() - self._start) / done * (self.total_steps - step)
        return time.strftime("%H:%M:%S", time.gmtime(remaining))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        if self._jsonl is not None:
            row = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        if "console" in self.backends:
            shown = "  ".join(f"{k.split('/')[-1] if k.count('/') else k}={_format(clean[k])}"
                              for k in CONSOLE_KEYS if k in clean)
            total = f"/{self.total_steps}" if self.total_steps else ""
            self.console.print(f"[bold]step {step}{total}[/] eta {self.eta(step)}  {shown}", highlight=False)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
