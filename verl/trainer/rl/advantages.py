"""The advantage stage over the *global* batch: the KL penalty in the reward (with its controller) and the
advantage estimators, whatever the number of data-parallel ranks.

Every statistic "over the batch" goes through `reduce`, which sums a float64 tensor over the actor's
data-parallel ranks (identity in one process): whitening uses summed moments and the KL controller the
summed per-sequence KL, so N ranks compute exactly what one rank would on the concatenated batch, and
every rank holds the same KL coefficient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl.algorithms import (
    ESTIMATORS,
    AdaptiveKLController,
    EstimatorParams,
    FixedKLController,
    kl_penalty,
    overlong_penalty,
    sequence_kl_sums,
)
from verl.batch import RolloutBatch
from verl.config.schema import AlgorithmConfig

Reduce = Callable[[torch.Tensor], torch.Tensor]


def local_sum(t: torch.Tensor) -> torch.Tensor:
    """The reduction of a single process."""
    return t


def kl_controller(algo: AlgorithmConfig) -> AdaptiveKLController | FixedKLController:
    """`algorithm.kl_ctrl`: the adaptive controller moves beta towards `kl_target`, the fixed one keeps it."""
    if algo.kl_ctrl == "adaptive":
        return AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)
    return FixedKLController(algo.kl_coef)


def apply_overlong_penalty(batch: RolloutBatch, algo: AlgorithmConfig, max_new_tokens: int) -> RolloutBatch:
    """DAPO: responses that run into the length limit lose reward (`algorithm.overlong_buffer`)."""
    if not algo.overlong_buffer:
        return batch
    penalty = overlong_penalty(batch.response_mask.sum(dim=1), max_new_tokens, algo.overlong_buffer,
                               algo.overlong_penalty).to(batch.scores)
    batch.scores = batch.scores + penalty
    batch.metrics |= {"reward/overlong_penalty": float(penalty.mean()),
                      "reward/overlong_frac": float((penalty < 0).float().mean())}
    return batch


def apply_kl_in_reward(batch: RolloutBatch, algo: AlgorithmConfig, kl_ctrl, reduce: Reduce = local_sum) -> RolloutBatch:
    """With `algorithm.kl_in_reward`, subtract beta x KL(actor || ref) from the token rewards, then move
    beta towards `kl_target` with the global batch's per-token KL (mean over tokens of a response, then
    over responses; verl's unit) and its global number of responses."""
    if not algo.kl_in_reward:
        return batch
    mask = batch.response_mask.float()
    kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, algo.kl_type) * mask
    batch.token_rewards = batch.token_rewards - kl_ctrl.value * kl
    sums = reduce(torch.cat([sequence_kl_sums(kl, mask), torch.tensor([float(len(batch))], dtype=torch.float64)]))
    kl_sum, counted, responses = sums.tolist()
    current = kl_sum / max(counted, 1.0)
    batch.metrics["kl/in_reward"] = current
    batch.metrics["kl/coef"] = float(kl_ctrl.value)
    kl_ctrl.update(current, int(responses))
    return batch


def estimate_advantages(batch: RolloutBatch, algo: AlgorithmConfig, reduce: Reduce = local_sum) -> RolloutBatch:
    """Advantages and returns from the token rewards (and the values, for GAE), by `algorithm.adv_estimator`."""
    params = EstimatorParams(gamma=algo.gamma, lam=algo.lam, norm_by_std=algo.norm_by_std, std_scope=algo.std_scope,
                             whiten_advantages=algo.whiten_advantages)
    batch.advantages, batch.returns = ESTIMATORS[algo.adv_estimator].compute(
        batch.token_rewards, batch.response_mask, values=batch.values, group_ids=batch.group_ids, params=params,
        reduce=reduce)
    return batch


__all__ = ["apply_kl_in_reward", "estimate_advantages", "local_sum"]
