"""Which rollout correction a run gets (`actor.rollout_correction.mode=auto` resolved) and why.

The correction costs nothing to get wrong where the sampler and the trainer can differ (vLLM's kernels and
weight copy, bfloat16 rounding, a stale engine), so it is on there; where they cannot (the hf engine sampling
with the trainer's own float32 weights) it is off, so that the update is bit-identical to no correction.
`verl check` prints the same decision the trainer makes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl.config.schema import RolloutCorrectionConfig, RunConfig
from verl.trainer.build.precision import LOW_PRECISION

AUTO_MODE = "token_tis"


@dataclass(frozen=True)
class CorrectionPlan:
    mode: str  # a mode of verl.algorithms.rollout_correction, or "off"
    reason: str
    settings: RolloutCorrectionConfig
    auto: bool  # chosen by mode=auto: a batch without sampler log-probs is then left uncorrected

    def describe(self) -> str:
        s = self.settings
        detail = {"token_tis": f"cap {s.cap}", "seq_tis": f"cap {s.cap}", "seq_tis_geo": f"cap {s.cap}",
                  "token_mask": f"keep ratios in [{s.lo}, {s.hi}]",
                  "seq_mask": f"keep responses with a ratio in [{s.lo}, {s.hi}]"}.get(self.mode)
        how = f"{self.mode} ({detail})" if detail else self.mode
        return f"rollout correction: {how}: {self.reason}"


def max_staleness(config: RunConfig) -> int:
    """How many updates old a trained response may be: `rollout.max_staleness` of an asynchronous rollout
    (`devices.rollout`), else 0."""
    return config.rollout.max_staleness if config.is_async else 0


def why_samplers_differ(config: RunConfig, compute: torch.dtype) -> str | None:
    """Why the sampler's log-probs can differ from the trainer's beyond rounding, or None when they cannot."""
    if config.rollout.engine != "hf":
        return (f"rollout.engine={config.rollout.engine} samples with its own kernels and its own copy of the "
                "weights")
    if compute in LOW_PRECISION:
        return (f"the policy computes in {str(compute).removeprefix('torch.')}: the sampler's cached decode "
                "and the trainer's full forward round differently")
    staleness = max_staleness(config)
    if staleness:
        return f"max_staleness={staleness}: responses may come from weights up to {staleness} updates old"
    return None


def explicit_plan(settings: RolloutCorrectionConfig) -> CorrectionPlan:
    """The plan without the device's view: an explicit mode as set, auto as off (tests, offline use)."""
    if settings.mode == "auto":
        return CorrectionPlan("off", "mode=auto without a device to decide on", settings, auto=True)
    return CorrectionPlan(settings.mode, f"set by actor.rollout_correction.mode={settings.mode}", settings,
                          auto=False)


def plan_correction(config: RunConfig, compute: torch.dtype) -> CorrectionPlan:
    """The mode of `actor.rollout_correction` for a policy that computes in `compute`, with its reason."""
    settings = config.actor.rollout_correction
    if settings.mode != "auto":
        return explicit_plan(settings)
    differ = why_samplers_differ(config, compute)
    if differ is None:
        return CorrectionPlan("off", "the hf engine samples with the trainer's own float32 weights, so the update "
                              "is bit-identical without a correction (mode=auto)", settings, auto=True)
    return CorrectionPlan(AUTO_MODE, f"{differ} (mode=auto)", settings, auto=True)


__all__ = ["AUTO_MODE", "CorrectionPlan", "explicit_plan", "max_staleness", "plan_correction", "why_samplers_differ"]
