"""DAPO's dynamic sampling: train only on groups whose rewards differ, drawing more prompts while short.

Every rank takes part in every round (the prompt stream and FSDP's collectives stay in step); the loop is
here, the drawing (get a batch, generate, score) is the trainer's stages, passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from verl.distributed.placement import Placement
from verl.trainer.batch import RolloutBatch, concat_batches, varied_groups


def accuracy_of(result: Any, scores: torch.Tensor) -> torch.Tensor:
    """[N] what the groups are filtered on: the reward's `acc` extra (`RewardResult.accuracy`) where it gave
    one, else the score before shaping (call it before the overlong penalty is added)."""
    base = scores.detach().clone()
    acc = getattr(result, "accuracy", None)  # an environment's own result type may not have it
    if acc is None:
        return base
    acc = acc.to(base)
    return torch.where(torch.isnan(acc), base, acc)


def filter_groups(batch: RolloutBatch | None, draw: Callable[[int], RolloutBatch | None], *, placement: Placement,
                  max_rounds: int, pad_token_id: int,
                  metrics: dict[str, float]) -> RolloutBatch | None:
    """Keep the groups whose accuracies differ (`varied_groups`); while some actor rank has fewer than its share, every rank
    `draw(round)`s and scores another batch, at most `max_rounds` times. A rank still short fills up with
    equal-reward groups, which the update skips (actor.skip_zero_advantage). None on non-actor ranks."""
    holds = placement.holds("actor")
    want = len(batch) if holds else 0
    kept, rejected, sampled, rounds = [], [], 0, 0
    current = batch
    while True:
        if holds:
            varied = varied_groups(current)
            kept.append(current.select(varied.nonzero().flatten()))
            rejected.append(current.select((~varied).nonzero().flatten()))
            sampled += len(current)
        short = sum(len(k) for k in kept) < want
        if rounds >= max_rounds or not placement.mean_over_owners({"short": float(short)} if holds else {}).get(
                "short", 0.0):
            break
        rounds += 1
        current = draw(rounds)
    metrics["dynamic_sampling/rounds"] = float(rounds)
    if not holds:
        return None
    out = concat_batches([*kept, *rejected], pad_token_id).select(torch.arange(want))
    out.metrics = batch.metrics
    filled = max(want - sum(len(k) for k in kept), 0)
    metrics["dynamic_sampling/varied_group_frac"] = sum(len(k) for k in kept) / max(sampled, 1)
    metrics["dynamic_sampling/filled_equal_frac"] = filled / max(want, 1)
    return out


__all__ = ["accuracy_of", "filter_groups"]
