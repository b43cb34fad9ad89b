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
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_returns,
    compute_rloo_advantages,
    kl_penalty,
    masked_moments,
    sequence_kl_sums,
    whiten_from_moments,
)
from verl.config.schema import AlgorithmConfig
from verl.trainer.batch import RolloutBatch

Reduce = Callable[[torch.Tensor], torch.Tensor]


def local_sum(t: torch.Tensor) -> torch.Tensor:
    """The reduction of a single process."""
    return t


def global_whiten(x: torch.Tensor, mask: torch.Tensor, reduce: Reduce) -> torch.Tensor:
    """Whiten with the mean and variance of the global batch; masked positions are 0."""
    return whiten_from_moments(x, mask, reduce(masked_moments(x, mask))) * mask


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
    batch.reward_metrics["kl/in_reward"] = current
    batch.reward_metrics["kl/coef"] = float(kl_ctrl.value)
    kl_ctrl.update(current, int(responses))
    return batch


def estimate_advantages(batch: RolloutBatch, algo: AlgorithmConfig, reduce: Reduce = local_sum) -> RolloutBatch:
    """Advantages and returns from the token rewards (and the values, for GAE)."""
    mask, rewards = batch.response_mask.float(), batch.token_rewards
    if algo.adv_estimator == "gae":
        adv, ret = compute_gae(rewards, batch.values, mask, algo.gamma, algo.lam)
        batch.advantages = global_whiten(adv, mask, reduce) if algo.whiten_advantages else adv
        batch.returns = ret
    elif algo.adv_estimator == "reinforce_pp":
        ret = compute_reinforce_pp_returns(rewards, mask, algo.gamma)
        batch.advantages = global_whiten(ret, mask, reduce) if algo.whiten_advantages else ret
        batch.returns = ret
    else:  # group estimators: a group's responses sit on one rank, so no reduction is needed
        scores = rewards.sum(-1)  # the score, minus the KL penalty when it is in the reward
        groups = batch.group_ids.to(scores.device)
        if algo.adv_estimator == "grpo":
            seq_adv = compute_grpo_advantages(scores, groups, algo.norm_by_std)
        else:
            seq_adv = compute_rloo_advantages(scores, groups)
        batch.advantages = seq_adv[:, None] * mask
        batch.returns = batch.advantages
    return batch


__all__ = ["apply_kl_in_reward", "estimate_advantages", "global_whiten", "local_sum"]
