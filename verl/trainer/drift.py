"""The on-policy guard: the sampler's log-probs against the trainer's on the same tokens.

An engine that samples from other weights (never synced, a stale copy, an adapter not delivered) turns every
step off-policy without a word; measured here over the actor ranks, it is an error naming the engine.
"""

from __future__ import annotations

import torch

from verl.algorithms import masked_moments
from verl.config.schema import RolloutConfig
from verl.distributed.placement import Placement
from verl.errors import RolloutError
from verl.trainer.batch import RolloutBatch


def drift_moments(trainer_logprobs: torch.Tensor, checked: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """|trainer - sampler| log-prob on the model-written tokens of `checked`: its `masked_moments` and max."""
    mask = checked.response_mask.bool()
    diff = torch.where(mask, (trainer_logprobs - checked.rollout_logprobs.to(trainer_logprobs)).abs(), 0.0)
    return masked_moments(diff, mask), diff.max()


def judge_drift(metrics: dict[str, float], moments: torch.Tensor, worst: torch.Tensor, *, rollout: RolloutConfig,
                placement: Placement, step: int) -> None:
    """Log the drift over the actor ranks into `metrics`; raise when it is over `rollout.max_logprob_drift`.

    With top-k / top-p the sampler reports the renormalised distribution, which lifts every sampled log-prob:
    the difference is logged but not held to the limit."""
    count, total, _ = placement.all_reduce_sum(moments, "actor").tolist()
    mean = total / max(count, 1.0)
    worst_value = float(placement.all_reduce_max(worst.reshape(1), "actor"))
    metrics["rollout/logprob_diff_mean"], metrics["rollout/logprob_diff_max"] = mean, worst_value
    processed = rollout.top_k > 0 or rollout.top_p < 1.0
    if rollout.max_logprob_drift is not None and not processed and mean > rollout.max_logprob_drift:
        raise RolloutError(
            f"step {step}: the {rollout.engine!r} rollout engine's log-probs differ from the policy's by "
            f"{mean:.4f} per token on average (max {worst_value:.4f}; limit rollout.max_logprob_drift="
            f"{rollout.max_logprob_drift}): it samples from other weights than the ones being trained. Fix: make "
            "the engine receive the policy's weights after every update (rollout.engine=hf always does), or "
            "raise rollout.max_logprob_drift if a low-precision engine is expected to differ this much")


__all__ = ["drift_moments", "judge_drift"]
