"""A warning, once, when a run has had no learning signal for several steps in a row.

A step teaches nothing when every GRPO group's rewards are equal (`reward/zero_std_group_frac` == 1: every
advantage is 0) or the gradient is exactly zero (`actor/grad_norm` == 0). A few such steps happen; many in a
row mean the run is burning compute, so it says so, with the usual causes, and keeps going.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

NO_SIGNAL_STEPS = 5  # consecutive training steps without a learning signal before the warning

CAUSES = ("every response of a prompt gets the same reward (prompts too easy or too hard for the model; a "
          "reward function that returns a constant, or 0 because it cannot parse the answer); rollout.n=1 "
          "with a group estimator such as GRPO (a group of one has no spread); sampling at temperature 0 "
          "(the n responses are identical); actor.lr=0 or a frozen model (zero gradient)")


def no_signal(metrics: Mapping[str, float]) -> str | None:
    """Why this step's metrics show no learning signal, or None (a step without these metrics, e.g. a
    validation-only row, is no evidence either way: None)."""
    frac = metrics.get("reward/zero_std_group_frac")
    if frac is not None and frac >= 1.0:
        return "reward/zero_std_group_frac=1.0 (every group's rewards are equal, so every advantage is 0)"
    grad = metrics.get("actor/grad_norm")
    if grad is not None and grad == 0.0:
        return "actor/grad_norm=0 (no gradient: the optimizer step was skipped)"
    return None


@dataclass
class SignalWatch:
    """Fed each training step's metrics (`observe`); warns once after `steps` consecutive steps without signal."""

    steps: int = NO_SIGNAL_STEPS
    run: int = 0
    warned: bool = False

    def observe(self, metrics: Mapping[str, float], step: int) -> str | None:
        """Count this step; returns the warning (issued through `warnings.warn`) the one time it fires, else None."""
        if "reward/zero_std_group_frac" not in metrics and "actor/grad_norm" not in metrics:
            return None  # not a training step's row
        why = no_signal(metrics)
        self.run = self.run + 1 if why is not None else 0
        if why is None or self.warned or self.run < self.steps:
            return None
        self.warned = True
        message = (f"no learning signal for {self.run} steps in a row (steps {step - self.run + 1}-{step}): {why}. "
                   f"Likely causes: {CAUSES}. Look at reward/mean and reward/std per step (`verl plot`) and at a few "
                   "samples (samples.jsonl) to see which")
        warnings.warn(message, stacklevel=3)
        return message


def watch(trainer: object, metrics: Mapping[str, float], step: int) -> None:
    """`SignalWatch.observe` on the trainer's own watch (made on first use), from rank 0 only."""
    if getattr(trainer, "rank", 0) != 0:
        return
    signal_watch = getattr(trainer, "_signal_watch", None)
    if signal_watch is None:
        signal_watch = SignalWatch()
        trainer._signal_watch = signal_watch  # type: ignore[attr-defined]
    signal_watch.observe(metrics, step)


__all__ = ["CAUSES", "NO_SIGNAL_STEPS", "SignalWatch", "no_signal", "watch"]
