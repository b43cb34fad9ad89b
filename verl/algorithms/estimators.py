"""The advantage estimators as one table: name -> what the estimator needs and how it is computed.

The config schema's allowed names, the critic decision and the batch checks (rollout.n >= 2 for group
baselines) all read this table, so adding an estimator is one entry here instead of a name repeated in
four places. `compute` maps token rewards to (advantages, returns) with the formulas of `advantages.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .advantages import (
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_returns,
    compute_rloo_advantages,
)
from .core import masked_moments, whiten_from_moments

Tensor = torch.Tensor
Reduce = Callable[[Tensor], Tensor]


def _identity(t: Tensor) -> Tensor:
    return t


@dataclass(frozen=True)
class EstimatorParams:
    """Algorithm settings an estimator may read (from `algorithm.*`); unused ones are ignored."""

    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    std_scope: str = "group"  # GRPO's std: of the group ("group") or of every score in the batch ("batch")
    whiten_advantages: bool = True


@dataclass(frozen=True)
class AdvantageEstimator:
    """One estimator's properties plus its compute function.

    needs_critic: values from a learned critic are an input (PPO).
    needs_groups: advantages compare the n samples of one prompt, so rollout.n must be >= 2.
    """

    name: str
    needs_critic: bool
    needs_groups: bool
    summary: str
    _compute: Callable[[Tensor, Tensor, Tensor | None, Tensor | None, EstimatorParams, Reduce], tuple[Tensor, Tensor]]

    def compute(self, token_rewards: Tensor, response_mask: Tensor, *, values: Tensor | None = None,
                group_ids: Tensor | None = None, params: EstimatorParams | None = None,
                reduce: Reduce = _identity) -> tuple[Tensor, Tensor]:
        """(advantages, returns), both [B, T] and zero outside the response mask where the formula says so.

        `reduce` sums the whitening moments over the data-parallel shards of the batch (identity for one
        shard), so whitening is over the global batch however it is split. Group estimators need none:
        a prompt's samples sit on one shard."""
        if self.needs_critic and values is None:
            raise ValueError(f"adv_estimator={self.name!r} needs the critic's values; pass values=[B, T]")
        if self.needs_groups and group_ids is None:
            raise ValueError(f"adv_estimator={self.name!r} compares samples of a prompt; pass group_ids=[B]")
        return self._compute(token_rewards, response_mask.float(), values, group_ids, params or EstimatorParams(),
                             reduce)


def _whiten_if(x: Tensor, mask: Tensor, p: EstimatorParams, reduce: Reduce) -> Tensor:
    if not p.whiten_advantages:
        return x
    return whiten_from_moments(x, mask, reduce(masked_moments(x, mask))) * mask


def _gae(rewards: Tensor, mask: Tensor, values: Tensor | None, _groups: Tensor | None,
         p: EstimatorParams, reduce: Reduce) -> tuple[Tensor, Tensor]:
    adv, ret = compute_gae(rewards, values, mask, p.gamma, p.lam)
    return _whiten_if(adv, mask, p, reduce), ret


def _reinforce_pp(rewards: Tensor, mask: Tensor, _values: Tensor | None, _groups: Tensor | None,
                  p: EstimatorParams, reduce: Reduce) -> tuple[Tensor, Tensor]:
    ret = compute_reinforce_pp_returns(rewards, mask, p.gamma)
    return _whiten_if(ret, mask, p, reduce), ret


def _reinforce_pp_baseline(rewards: Tensor, mask: Tensor, _values: Tensor | None, groups: Tensor | None,
                           p: EstimatorParams, reduce: Reduce) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: the score minus its group's mean, on every response token, whitened over the
    global batch (the group baseline removes the prompt's difficulty; the batch whitening sets the scale)."""
    scores = rewards.sum(-1)
    centred = compute_grpo_advantages(scores, groups.to(scores.device), norm_by_std=False)[:, None] * mask
    return _whiten_if(centred, mask, p, reduce), centred


def _outcome(per_sequence: Callable[[Tensor, Tensor, EstimatorParams, Reduce], Tensor]):
    """Sequence-level estimators score the summed token rewards (score minus any in-reward KL)."""

    def compute(rewards: Tensor, mask: Tensor, _values: Tensor | None, groups: Tensor | None,
                p: EstimatorParams, reduce: Reduce) -> tuple[Tensor, Tensor]:
        scores = rewards.sum(-1)
        adv = per_sequence(scores, groups.to(scores.device), p, reduce)[:, None] * mask
        return adv, adv

    return compute


def _grpo(scores: Tensor, groups: Tensor, p: EstimatorParams, reduce: Reduce) -> Tensor:
    """GRPO; with `std_scope="batch"` the group-centred score is divided by the std of every score in the
    global batch (Lite PPO's "group mean, batch std"; TRL's `scale_rewards="batch"`)."""
    if not (p.norm_by_std and p.std_scope == "batch"):
        return compute_grpo_advantages(scores, groups, p.norm_by_std)
    count, total, squares = reduce(masked_moments(scores, torch.ones_like(scores, dtype=torch.bool))).unbind()
    std = ((squares - total * total / count) / (count - 1).clamp(min=1)).clamp(min=0).sqrt()
    return (compute_grpo_advantages(scores, groups, norm_by_std=False) / (std + 1e-6)).to(scores.dtype)


ESTIMATORS: dict[str, AdvantageEstimator] = {
    e.name: e
    for e in (
        AdvantageEstimator("gae", needs_critic=True, needs_groups=False,
                           summary="PPO: generalised advantage estimation against a learned critic",
                           _compute=_gae),
        AdvantageEstimator("grpo", needs_critic=False, needs_groups=True,
                           summary="GRPO: score minus the group mean (divided by the group or batch std)",
                           _compute=_outcome(_grpo)),
        AdvantageEstimator("rloo", needs_critic=False, needs_groups=True,
                           summary="RLOO: score minus the mean of the other samples of the prompt",
                           _compute=_outcome(lambda s, g, p, r: compute_rloo_advantages(s, g))),
        AdvantageEstimator("reinforce_pp", needs_critic=False, needs_groups=False,
                           summary="REINFORCE++: discounted returns whitened over the batch",
                           _compute=_reinforce_pp),
        AdvantageEstimator("reinforce_pp_baseline", needs_critic=False, needs_groups=True,
                           summary="REINFORCE++-baseline: score minus the group mean, whitened over "
                           "the batch", _compute=_reinforce_pp_baseline),
    )
}

ESTIMATOR_NAMES: tuple[str, ...] = tuple(ESTIMATORS)
"""Allowed `algorithm.adv_estimator` values, in table order (the config schema's Literal)."""


def get_estimator(name: str) -> AdvantageEstimator:
    """The table entry for `name`; KeyError lists the known names (config validation catches typos first)."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        raise KeyError(f"unknown advantage estimator {name!r}; known: {', '.join(ESTIMATOR_NAMES)}") from None


__all__ = ["AdvantageEstimator", "EstimatorParams", "ESTIMATORS", "ESTIMATOR_NAMES", "get_estimator"]
