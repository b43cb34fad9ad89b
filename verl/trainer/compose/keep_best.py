"""`checkpoint.keep_best` and `trainer.stop_when`: what the training loop reads in each validation's metrics.

The loop offers each validation's metrics (after training steps; the validation before training only
checks the metric's name, since the model as loaded is `model.path` already). A value that beats the record
makes that step's checkpoint the best: the loop saves it (even off `save_interval`) and the checkpoint
manager marks and keeps it (verl.checkpoint.best). The record travels in every checkpoint's extra state, so a
resume continues with the best as of the step it resumes from. `StopRule` ends training at the first
validation after a step whose metric reaches `trainer.stop_when`'s value.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl.checkpoint.best import BestRecord, improves
from verl.config.run_settings import parse_stop_rule
from verl.config.schema import RunConfig
from verl.errors import ConfigError
from verl.utils.suggest import did_you_mean


class KeepBest:
    """The best value of one validation metric so far, and the checkpoint that holds it."""

    def __init__(self, metric: str, mode: str) -> None:
        self.metric, self.mode = metric, mode
        self.record: BestRecord | None = None

    @classmethod
    def from_config(cls, config: RunConfig) -> KeepBest | None:
        c = config.checkpoint
        return None if c.keep_best is None else cls(c.keep_best, c.keep_best_mode)

    def check(self, metrics: Mapping[str, float]) -> None:
        """Refuse a metric name this run's validation does not log, naming the ones it does."""
        require_metric("checkpoint.keep_best", self.metric, metrics)

    def offer(self, step: int, metrics: Mapping[str, float]) -> BestRecord | None:
        """The new record when this validation's value beats the best so far (None otherwise)."""
        self.check(metrics)
        value = float(metrics[self.metric])
        if not improves(value, self.record, self.mode):
            return None
        self.record = BestRecord(step, self.metric, value, self.mode)  # type: ignore[arg-type]
        return self.record

    def state_dict(self) -> dict[str, Any]:
        return {"record": None if self.record is None else self.record.to_dict()}

    def load_state_dict(self, state: Mapping[str, Any] | None, checkpoints: Path) -> None:
        """The record a checkpoint saved, unless it is for another metric or mode, or its folder is gone (a
        resume into an older step after the run went on): then the next validation sets a new one."""
        record = BestRecord.from_dict((state or {}).get("record"))
        keep = (record is not None and (record.metric, record.mode) == (self.metric, self.mode)
                and (checkpoints / record.folder).is_dir())
        self.record = record if keep else None


class StopRule:
    """`trainer.stop_when` (`METRIC>=VALUE` or `METRIC<=VALUE`): whether a validation ends the run."""

    def __init__(self, rule: str) -> None:
        self.rule = rule
        self.metric, self.op, self.value = parse_stop_rule(rule)

    @classmethod
    def from_config(cls, config: RunConfig) -> StopRule | None:
        return None if config.trainer.stop_when is None else cls(config.trainer.stop_when)

    def check(self, metrics: Mapping[str, float]) -> None:
        require_metric("trainer.stop_when", self.metric, metrics)

    def reached(self, metrics: Mapping[str, float]) -> bool:
        """Whether this validation's value is at or past the rule's (NaN never is)."""
        self.check(metrics)
        value = float(metrics[self.metric])
        return value >= self.value if self.op == ">=" else value <= self.value


def require_metric(key: str, metric: str, metrics: Mapping[str, float]) -> None:
    """Refuse a config `key` naming a metric this run's validation does not log, naming the ones it does."""
    if metric in metrics:
        return
    logged = sorted(k for k in metrics if k.startswith("val/"))
    raise ConfigError(f"{key}={metric}: validation logged no such metric.{did_you_mean(metric, logged)} It logs: "
                      f"{', '.join(logged) or 'nothing'}. Fix: set {key} to one of them")


__all__ = ["KeepBest", "StopRule", "require_metric"]
