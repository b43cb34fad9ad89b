"""Position ids from an attention mask: the one rule shared by rollout, training forwards and scorers.

The actor's log-probs are only comparable to the rollout's when both fed the model the same positions, so
every place that builds position ids calls this function rather than restating the formula.
"""

from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Long positions counting only real tokens: the first real token is 0, every pad is 0.

    Left padding therefore does not shift positions; pads (left or right) get 0, a value the attention
    mask hides anyway. Accepts bool, integer or float masks of any leading shape ``[..., T]``.
    """
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


__all__ = ["position_ids_from_mask"]
