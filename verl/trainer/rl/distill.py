"""On-policy distillation in the RL step: the teacher's log-probs of the student's tokens become the
reverse-KL term (`algorithm.distill`; the formulas are `verl.algorithms.distill`'s).

The KL's batch mean (the advantages' baseline and the logged `distill/reverse_kl`) is over the tokens of the
*global* batch, summed over the actor ranks as the other advantage statistics are.
"""

from __future__ import annotations

import torch

from verl.algorithms.distill import reverse_kl, reverse_kl_advantages
from verl.batch import RolloutBatch
from verl.config.schema import DistillConfig
from verl.trainer.rl.advantages import Reduce, local_sum


def describe(cfg: DistillConfig) -> str:
    """What `verl check` says the run's distillation does."""
    how = (f"-{cfg.coef} x the per-token reverse KL added to the advantages"
           + (f" (future tokens' KL discounted by {cfg.discount})" if cfg.discount else "")
           if cfg.mode == "reward" else f"{cfg.coef} x 0.5 (log pi_s - log pi_t)^2 added to the actor's loss")
    task = "plus the task reward" if cfg.task_reward else "alone (algorithm.distill.task_reward=false)"
    return f"distillation from {cfg.teacher_path}: {how}, {task}"


def apply_distillation(batch: RolloutBatch, cfg: DistillConfig, reduce: Reduce = local_sum) -> RolloutBatch:
    """After the estimator: without `task_reward` the task's advantages are dropped; in mode=reward the
    reverse-KL advantages are added (mode=loss adds its term in the update instead)."""
    mask = batch.response_mask.to(torch.float64)
    kl = reverse_kl(batch.old_logprobs.double(), batch.teacher_logprobs.double()) * mask
    total, tokens = reduce(torch.stack([kl.sum(), mask.sum()])).tolist()
    mean = total / max(tokens, 1.0)
    batch.metrics["distill/reverse_kl"] = mean
    if not cfg.task_reward:
        batch.advantages = torch.zeros_like(batch.advantages)
    if cfg.mode == "reward":
        extra = reverse_kl_advantages(batch.old_logprobs.double(), batch.teacher_logprobs.double(), mask,
                                      coef=cfg.coef, discount=cfg.discount, mean=mean)
        batch.advantages = batch.advantages + extra.to(batch.advantages.dtype)
    return batch


__all__ = ["apply_distillation", "describe"]
