"""The records a scoring passes around: the batch being scored, its result, and how far training is."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


@dataclass
class RewardResult:
    """Per-sample rewards plus what to log.

    scores: float32 [N], the weighted sum of the functions that apply to each sample.
    metrics: means to log, `reward/<fn>/score` and `reward/<fn>/<key>` for numeric extra keys of dict returns.
    per_function: unweighted float32 [N] scores per function; 0 where the function does not apply.
    applied: bool [N] per function, True where it applies (so a mean over per_function can skip the rest).
    extras: per sample, {function: {key: value}} for the extra keys of dict returns that are not finite
        numbers (verl's math_dapo returns its parsed answer as `pred`): they cannot be averaged, so they go
        with the sample (samples.jsonl) instead of the metrics; empty dicts where there are none.
    accuracy: float32 [N], the weighted sum of the `acc` extras of the functions that return one for a sample,
        NaN where none does; None when no function returned one. DAPO's dynamic sampling filters on it
        (correctness, not the shaped score).
    """

    scores: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    per_function: dict[str, torch.Tensor] = field(default_factory=dict)
    applied: dict[str, torch.Tensor] = field(default_factory=dict)
    extras: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    accuracy: torch.Tensor | None = None


@dataclass(frozen=True)
class TrainingProgress:
    """Where training is, for reward functions that shape rewards by it: what TRL passes as `trainer_state`
    (the fields of transformers' `TrainerState` that such functions read). `global_step` counts the
    optimizer steps done before this batch; `epoch` the passes over the training prompts completed."""

    global_step: int = 0
    max_steps: int | None = None
    epoch: int = 0


class _Samples(NamedTuple):
    """One batch to score, a list entry per sample in each field."""

    prompts: Sequence[Any]
    responses: Sequence[str]
    ground_truths: Sequence[Any]
    metas: list[dict[str, Any]]
    data_sources: Sequence[str | None]
    response_ids: Sequence[Sequence[int]] | None = None  # each response's token ids, where the caller has them
