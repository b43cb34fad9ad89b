"""The estimator table: its properties drive the config, and its compute matches the formulas it wraps."""

from __future__ import annotations

import typing

import pytest
import torch

from verl.algorithms import (
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_returns,
    compute_rloo_advantages,
    masked_whiten,
)
from verl.algorithms.estimators import ESTIMATOR_NAMES, ESTIMATORS, EstimatorParams, get_estimator
from verl.config import load_config
from verl.config.schema import AlgorithmConfig

G = torch.Generator().manual_seed(0)
REWARDS = torch.randn(6, 5, generator=G, dtype=torch.float64)
VALUES = torch.randn(6, 5, generator=G, dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0],
                     [1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])


def _reference(name: str, p: EstimatorParams) -> tuple[torch.Tensor, torch.Tensor]:
    """What RLTrainer.estimate_advantages computes, written out with the public formulas."""
    mask = MASK.double()
    if name == "gae":
        adv, ret = compute_gae(REWARDS, VALUES, mask, p.gamma, p.lam)
        return (masked_whiten(adv, mask) * mask if p.whiten_advantages else adv), ret
    if name == "reinforce_pp":
        ret = compute_reinforce_pp_returns(REWARDS, mask, p.gamma)
        return (masked_whiten(ret, mask) * mask if p.whiten_advantages else ret), ret
    scores = REWARDS.sum(-1)
    if name == "reinforce_pp_baseline":
        return _reinforce_pp_baseline(scores, mask, p.whiten_advantages)
    seq = (compute_grpo_advantages(scores, GROUPS, p.norm_by_std) if name == "grpo"
           else compute_rloo_advantages(scores, GROUPS))
    return seq[:, None] * mask, seq[:, None] * mask


def _reinforce_pp_baseline(scores, mask, whiten):
    """Written out in float64 with loops: score minus its group's mean on every response token, then
    (x - mean) / sqrt(unbiased var + 1e-8) over all response tokens of the batch."""
    centred = torch.zeros_like(mask)
    for i in range(len(scores)):
        group = [j for j in range(len(scores)) if GROUPS[j] == GROUPS[i]]
        centred[i] = (scores[i] - sum(scores[j] for j in group) / len(group)) * mask[i]
    if not whiten:
        return centred, centred
    tokens = [float(centred[i, t]) for i in range(len(scores)) for t in range(mask.shape[1]) if mask[i, t]]
    mean = sum(tokens) / len(tokens)
    var = sum((x - mean) ** 2 for x in tokens) / (len(tokens) - 1)
    return (centred - mean) / (var + 1e-8) ** 0.5 * mask, centred


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
@pytest.mark.parametrize("params", [EstimatorParams(), EstimatorParams(gamma=0.9, lam=0.8, norm_by_std=False,
                                                                       whiten_advantages=False)])
def test_compute_matches_the_formulas(name, params):
    adv, ret = ESTIMATORS[name].compute(REWARDS, MASK, values=VALUES, group_ids=GROUPS, params=params)
    want_adv, want_ret = _reference(name, params)
    assert adv.dtype == torch.float64
    exact = name != "reinforce_pp_baseline"  # its reference sums in another order
    torch.testing.assert_close(adv, want_adv, rtol=0 if exact else 1e-12, atol=0 if exact else 1e-12)
    torch.testing.assert_close(ret, want_ret, rtol=0 if exact else 1e-12, atol=0 if exact else 1e-12)


def test_properties():
    assert [n for n, e in ESTIMATORS.items() if e.needs_critic] == ["gae"]
    assert sorted(n for n, e in ESTIMATORS.items() if e.needs_groups) == ["grpo", "reinforce_pp_baseline", "rloo"]


def test_missing_inputs_are_named():
    with pytest.raises(ValueError, match="'gae' needs the critic's values"):
        ESTIMATORS["gae"].compute(REWARDS, MASK)
    with pytest.raises(ValueError, match="'rloo' compares samples of a prompt; pass group_ids"):
        ESTIMATORS["rloo"].compute(REWARDS, MASK)
    with pytest.raises(KeyError, match="known: gae, grpo, rloo, reinforce_pp"):
        get_estimator("ppo")


def test_config_reads_the_table():
    field = AlgorithmConfig.model_fields["adv_estimator"]
    assert typing.get_args(field.annotation) == ESTIMATOR_NAMES
    for name, est in ESTIMATORS.items():
        assert load_config(overrides=[f"algorithm.adv_estimator={name}"]).needs_critic is est.needs_critic


def test_grpo_with_the_batch_std_divides_by_the_std_of_every_score():
    """std_scope="batch" (Lite PPO; TRL's scale_rewards="batch"): group-centred scores over the std of all the
    batch's scores, written out in float64; on two data-parallel shards (moments summed) the same numbers."""
    params = EstimatorParams(std_scope="batch")
    adv, _ = ESTIMATORS["grpo"].compute(REWARDS, MASK, group_ids=GROUPS, params=params)
    scores = [float(x) for x in REWARDS.sum(-1)]
    mean = sum(scores) / len(scores)
    std = (sum((x - mean) ** 2 for x in scores) / (len(scores) - 1)) ** 0.5
    want = torch.zeros(6, 5, dtype=torch.float64)
    for i in range(6):
        group = [scores[j] for j in range(6) if GROUPS[j] == GROUPS[i]]
        want[i] = (scores[i] - sum(group) / len(group)) / (std + 1e-6) * MASK[i].double()
    torch.testing.assert_close(adv, want, rtol=1e-12, atol=1e-12)

    from verl.algorithms import masked_moments

    halves = [slice(0, 3), slice(3, 6)]  # one group per shard
    moments = [masked_moments(REWARDS[h].sum(-1), torch.ones(3, dtype=torch.bool)) for h in halves]
    sharded = [ESTIMATORS["grpo"].compute(REWARDS[h], MASK[h], group_ids=GROUPS[h], params=params,
                                          reduce=lambda m, k=k: m + moments[1 - k])[0] for k, h in enumerate(halves)]
    torch.testing.assert_close(torch.cat(sharded), want, rtol=1e-12, atol=1e-12)
