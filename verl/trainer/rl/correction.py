"""Where the sampler and the trainer may differ, in one place: which rollout correction a run gets
(`actor.rollout_correction.mode=auto` resolved, and why) and the on-policy guard that measures the drift
between the sampler's and the trainer's log-probs.

Correction: The correction costs nothing to get wrong where the sampler and the trainer can differ (vLLM's kernels and
weight copy, bfloat16 rounding, a stale engine), so it is on there; where they cannot (the hf engine sampling
with the trainer's own float32 weights) it is off, so that the update is bit-identical to no correction.
`verl check` prints the same decision the trainer makes.

Drift: An engine that samples from other weights (never synced, a stale copy, an adapter not delivered) turns every
step off-policy without a word; measured here over the actor ranks, it is an error naming the engine.
Three limits: the fixed `rollout.max_logprob_drift` (gross errors); the run's own numeric noise, measured at
its first step (sampler and trainer then hold the same initial weights, synced or not) times
`rollout.drift_noise_ratio` (an engine one update behind); and a drift that keeps growing over
`rollout.drift_growth_steps` (an engine falling further behind with every update).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verl.algorithms import masked_moments
from verl.batch import RolloutBatch
from verl.config.schema import RolloutConfig, RolloutCorrectionConfig, RunConfig
from verl.distributed.placement import Placement
from verl.errors import RolloutError
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


@dataclass(frozen=True)
class OldLogprobPlan:
    """Where an update that needs the old policy's log-probs takes them (`actor.old_logprobs` resolved)."""

    from_sampler: bool  # the rollout's log-probs; else a no-grad forward of the actor recomputes them
    reason: str

    def describe(self) -> str:
        source = "the sampler's" if self.from_sampler else "recomputed"
        return f"old log-probs (where the update needs them): {source}: {self.reason}"


def why_recompute(config: RunConfig, compute: torch.dtype) -> str | None:
    """Why the sampler's log-probs cannot stand for the old policy's, or None when they can."""
    differ = why_samplers_differ(config, compute)
    if differ is not None:
        return differ
    if config.rollout.filters:
        return ("rollout.top_k/top_p: the sampler reports log-probs of the filtered, renormalised distribution, "
                "not the policy's")
    mode = config.actor.rollout_correction.mode
    if mode not in ("auto", "off"):
        return f"actor.rollout_correction.mode={mode} corrects the sampler towards the trainer's old log-probs"
    return None


def plan_old_logprobs(config: RunConfig, compute: torch.dtype) -> OldLogprobPlan:
    """`actor.old_logprobs` for a policy that computes in `compute`, with its reason."""
    setting = config.actor.old_logprobs
    guard = ("the update's forwards before its first optimizer step, on the weights that sampled, still measure "
             "the drift every step")
    if setting == "recompute":
        return OldLogprobPlan(False, "set by actor.old_logprobs=recompute")
    if setting == "sampler":
        caveat = why_samplers_differ(config, compute)  # allowed (verl's bypass mode); top-k/top-p is refused
        return OldLogprobPlan(True, "set by actor.old_logprobs=sampler (verl's bypass mode); PPO's ratio is then "
                              f"taken against the sampler{f', although {caveat}' if caveat else ''}; {guard}")
    why = why_recompute(config, compute)
    if why is not None:
        return OldLogprobPlan(False, f"{why} (actor.old_logprobs=auto)")
    return OldLogprobPlan(True, "the hf engine samples with the trainer's own float32 weights, so its log-probs "
                          f"are the old policy's up to rounding and no pass is spent on them; {guard} "
                          "(actor.old_logprobs=auto)")


def plan_correction(config: RunConfig, compute: torch.dtype) -> CorrectionPlan:
    """The mode of `actor.rollout_correction` for a policy that computes in `compute`, with its reason."""
    settings = config.actor.rollout_correction
    if settings.mode != "auto":
        return explicit_plan(settings)
    if plan_old_logprobs(config, compute).from_sampler:
        return CorrectionPlan("off", "actor.old_logprobs takes the sampler's log-probs as the old policy, so "
                              "pi_old / pi_rollout is 1 and there is nothing to correct (mode=auto)", settings,
                              auto=True)
    differ = why_samplers_differ(config, compute)
    if differ is None:
        return CorrectionPlan("off", "the hf engine samples with the trainer's own float32 weights, so the update "
                              "is bit-identical without a correction (mode=auto)", settings, auto=True)
    return CorrectionPlan(AUTO_MODE, f"{differ} (mode=auto)", settings, auto=True)


NOISE_FLOOR = 1e-6  # per token: below it a float32 drift is rounding whatever the first step measured
GROWTH_OVER_NOISE = 4.0  # a growing drift is judged once it is this many times the noise
GROWTH_FACTOR = 2.0  # ... and at least this many times what it was at the window's start


def drift_moments(trainer_logprobs: torch.Tensor, checked: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """|trainer - sampler| log-prob on the model-written tokens of `checked`: its `masked_moments` and max."""
    mask = checked.response_mask.bool()
    diff = torch.where(mask, (trainer_logprobs - checked.rollout_logprobs.to(trainer_logprobs)).abs(), 0.0)
    return masked_moments(diff, mask), diff.max()


@dataclass
class DriftGuard:
    """The calibrated limits' state: the noise measured at the run's first step and the recent drifts (the
    same on every actor rank: they are means over all of them). `noise` is saved with the checkpoint."""

    noise: float | None = None
    recent: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, float | None]:
        return {"noise": self.noise}

    def load_state_dict(self, state: dict[str, float | None]) -> None:
        self.noise = state.get("noise")

    def judge(self, mean: float, *, rollout: RolloutConfig, step: int) -> str | None:
        """Why `mean` (this step's drift) means a stale engine, or None. Step 1 calibrates."""
        if self.noise is None:
            if step == 1:  # no update yet: whatever the engine's sync, sampler and trainer hold the same weights
                self.noise = mean
            return None
        floor = max(self.noise, NOISE_FLOOR)
        if rollout.drift_noise_ratio is not None and mean > rollout.drift_noise_ratio * floor:
            return (f"{mean / floor:.0f}x the run's own numeric noise ({self.noise:.2e} per token, measured at "
                    f"step 1 on the initial weights; limit rollout.drift_noise_ratio={rollout.drift_noise_ratio})")
        window = rollout.drift_growth_steps
        if window:
            self.recent = [*self.recent, mean][-window:]
            rises = sum(b > a for a, b in zip(self.recent, self.recent[1:], strict=False))
            if (len(self.recent) == window and rises >= window - 2 and mean > GROWTH_FACTOR * self.recent[0]
                    and mean > GROWTH_OVER_NOISE * floor):
                return (f"a drift that grew on {rises} of the last {window - 1} updates, from "
                        f"{self.recent[0]:.2e} to {mean:.2e} per token (limit rollout.drift_growth_steps="
                        f"{window}): the engine falls further behind with every update")
        return None


def judge_drift(metrics: dict[str, float], moments: torch.Tensor, worst: torch.Tensor, *, rollout: RolloutConfig,
                placement: Placement, step: int, guard: DriftGuard | None = None, log_only: bool = False) -> None:
    """Log the drift over the actor ranks into `metrics`; raise when it is over `rollout.max_logprob_drift`,
    or over the limits `guard` calibrated on this run's own noise.

    With top-k / top-p the sampler reports the renormalised distribution, which lifts every sampled log-prob:
    the difference is logged but not held to the limits, as it is with `log_only` (samples of older weights,
    asynchronous RL: the rollout correction weighs them)."""
    count, total, _ = placement.all_reduce_sum(moments, "actor").tolist()
    mean = total / max(count, 1.0)
    worst_value = float(placement.all_reduce_max(worst.reshape(1), "actor"))
    metrics["rollout/logprob_diff_mean"], metrics["rollout/logprob_diff_max"] = mean, worst_value
    processed = rollout.filters
    if processed or log_only:
        return
    if rollout.max_logprob_drift is not None and mean > rollout.max_logprob_drift:
        raise RolloutError(
            f"step {step}: the {rollout.engine!r} rollout engine's log-probs differ from the policy's by "
            f"{mean:.4f} per token on average (max {worst_value:.4f}; limit rollout.max_logprob_drift="
            f"{rollout.max_logprob_drift}): it samples from other weights than the ones being trained. Fix: make "
            "the engine receive the policy's weights after every update (rollout.engine=hf always does), or "
            "raise rollout.max_logprob_drift if a low-precision engine is expected to differ this much")
    stale = guard.judge(mean, rollout=rollout, step=step) if guard is not None else None
    if stale is not None:
        raise RolloutError(
            f"step {step}: the {rollout.engine!r} rollout engine's log-probs differ from the policy's by "
            f"{mean:.2e} per token on average, {stale}: it samples from older weights than the ones being "
            "trained. Fix: make the engine receive the policy's weights after every update (a skipped or "
            "failed weight sync), or set rollout.drift_noise_ratio / rollout.drift_growth_steps higher (null / "
            "0 turns that limit off) if the difference is expected")



def combined_moments(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`drift_moments` of several micro-batches as one: the moments summed, the worst token's the largest."""
    return torch.stack([m for m, _ in parts]).sum(0), torch.stack([w for _, w in parts]).max()


__all__ = ["AUTO_MODE", "CorrectionPlan", "DriftGuard", "combined_moments", "drift_moments", "explicit_plan",
           "judge_drift", "max_staleness", "plan_correction", "why_samplers_differ"]
