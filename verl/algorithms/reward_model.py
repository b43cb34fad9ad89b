"""The Bradley–Terry loss of a reward model on preference pairs (what TRL's RewardTrainer and OpenRLHF's
train_rm minimise)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .core import _check_same_shape


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coefficient: float = 0.0,
) -> torch.Tensor:
    """Per-pair losses, shaped like the inputs: -logsigmoid(r_c - r_r - margin) + c (r_c + r_r)^2.

    `margin` (per pair, default 0) asks the chosen answer to win by at least that much, as in Llama 2's reward
    models; pairs without one pass 0. The centring term (c = `center_coefficient`, TRL's
    `center_rewards_coefficient`) pulls each pair's mean reward to 0: the Bradley–Terry loss only sees
    differences, so without it the rewards drift by a free constant, which a PPO critic then has to chase.
    The mean of these losses over a batch is TRL's loss.
    """
    _check_same_shape("chosen_rewards", chosen_rewards, rejected_rewards=rejected_rewards)
    if margin is not None:
        _check_same_shape("chosen_rewards", chosen_rewards, margin=margin)
    if not center_coefficient >= 0.0:
        raise ValueError(f"center_coefficient={center_coefficient!r} must be >= 0")
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    losses = -F.logsigmoid(diff)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen_rewards + rejected_rewards) ** 2
    return losses


__all__ = ["bradley_terry_loss"]
