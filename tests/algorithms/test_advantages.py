"""Advantage estimators against plain-Python float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from verl.algorithms import (
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_returns,
    compute_rloo_advantages,
    place_score_on_last_token,
)

MASK = torch.tensor(
    [
        [1, 1, 1, 1, 1, 1, 1],
        [1, 1, 0, 0, 1, 1, 0],  # gap in the middle, padding at the end
        [0, 0, 0, 0, 0, 0, 0],  # empty
        [0, 1, 1, 0, 1, 0, 0],  # left padding, gap, right padding
        [0, 0, 0, 0, 0, 0, 1],  # a single token
    ]
)


def _rand(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(MASK.shape, generator=g, dtype=torch.float64)


def _garbage_under_mask(x: torch.Tensor) -> torch.Tensor:
    """What lies under the mask must not matter: fill it with huge values and NaN."""
    x = x.clone()
    x[MASK == 0] = 1e9
    x[1, 2] = float("nan")
    return x


def ref_gae(rewards, values, mask, gamma, lam):
    B, T = len(mask), len(mask[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t]]
        gae = 0.0
        for k in range(len(idx) - 1, -1, -1):
            t = idx[k]
            next_v = values[b][idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            gae = delta + gamma * lam * gae
            adv[b][t] = gae
            ret[b][t] = gae + values[b][t]
    return adv, ret


def ref_returns(rewards, mask, gamma):
    B, T = len(mask), len(mask[0])
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        g = 0.0
        for t in range(T - 1, -1, -1):
            if mask[b][t]:
                g = rewards[b][t] + gamma * g
                out[b][t] = g
    return out


def ref_group_adv(scores, ids, kind, norm_by_std=True, eps=1e-6):
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    out = [0.0] * len(scores)
    for members in groups.values():
        n = len(members)
        if n == 1:
            continue
        vals = [scores[i] for i in members]
        mean = sum(vals) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
        for i in members:
            if kind == "rloo":
                out[i] = scores[i] - (sum(vals) - scores[i]) / (n - 1)
            elif norm_by_std:
                out[i] = (scores[i] - mean) / (std + eps)
            else:
                out[i] = scores[i] - mean
    return out


def _assert_close(got: torch.Tensor, want, tol: float) -> None:
    flat_got = got.flatten().tolist()
    flat_want = torch.tensor(want, dtype=torch.float64).flatten().tolist()
    assert flat_got == pytest.approx(flat_want, abs=tol, rel=tol)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.5)])
def test_gae_matches_reference(gamma, lam):
    rewards, values = _rand(0), _rand(1)
    want_adv, want_ret = ref_gae(rewards.tolist(), values.tolist(), MASK.tolist(), gamma, lam)
    adv, ret = compute_gae(_garbage_under_mask(rewards), _garbage_under_mask(values), MASK, gamma, lam)
    _assert_close(adv, want_adv, 1e-12)
    _assert_close(ret, want_ret, 1e-12)
    adv32, ret32 = compute_gae(rewards.float(), values.float(), MASK.bool(), gamma, lam)
    assert adv32.dtype == torch.float32 and ret32.dtype == torch.float32
    _assert_close(adv32, want_adv, 1e-5)
    _assert_close(ret32, want_ret, 1e-5)


def test_gae_hand_case():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.5, 0.5]])
    adv, ret = compute_gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.95)
    # delta = [-0.05, -0.05, 0.5]; A2 = 0.5, A1 = -0.05 + 0.855 * 0.5, A0 = -0.05 + 0.855 * A1
    assert adv[0].tolist() == pytest.approx([0.2727625, 0.3775, 0.5])
    assert ret[0].tolist() == pytest.approx([0.7727625, 0.8775, 1.0])
    # the same tokens with a masked gap in between give the same numbers
    rewards = torch.tensor([[0.0, 9.0, 0.0, 1.0, 3.0]])
    values = torch.tensor([[0.5, 7.0, 0.5, 0.5, 2.0]])
    adv, ret = compute_gae(rewards, values, torch.tensor([[1, 0, 1, 1, 0]]), gamma=0.9, lam=0.95)
    assert adv[0].tolist() == pytest.approx([0.2727625, 0.0, 0.3775, 0.5, 0.0])
    assert ret[0].tolist() == pytest.approx([0.7727625, 0.0, 0.8775, 1.0, 0.0])


def test_gae_and_returns_carry_no_gradient():
    values = _rand(1).requires_grad_(True)
    adv, ret = compute_gae(_rand(0), values, MASK, 1.0, 1.0)
    assert not adv.requires_grad and not ret.requires_grad


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_reinforce_pp_returns_match_reference(gamma):
    rewards = _rand(2)
    want = ref_returns(rewards.tolist(), MASK.tolist(), gamma)
    _assert_close(compute_reinforce_pp_returns(_garbage_under_mask(rewards), MASK, gamma), want, 1e-12)
    out32 = compute_reinforce_pp_returns(rewards.float(), MASK, gamma)
    assert out32.dtype == torch.float32
    _assert_close(out32, want, 1e-5)


def test_reinforce_pp_hand_case():
    out = compute_reinforce_pp_returns(
        torch.tensor([[1.0, 5.0, 2.0, 4.0, 8.0]]), torch.tensor([[1, 0, 1, 1, 0]]), gamma=0.5
    )
    assert out[0].tolist() == pytest.approx([1 + 0.5 * (2 + 0.5 * 4), 0.0, 2 + 0.5 * 4, 4.0, 0.0])


IDS = torch.tensor([7, -3, 7, 100, -3, 7, 42, 100, 7])  # unsorted, non-contiguous; 42 is alone


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_reference(norm_by_std):
    scores = torch.randn(len(IDS), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = ref_group_adv(scores.tolist(), IDS.tolist(), "grpo", norm_by_std)
    _assert_close(compute_grpo_advantages(scores, IDS, norm_by_std=norm_by_std), want, 1e-12)
    out32 = compute_grpo_advantages(scores.float(), IDS.int(), norm_by_std=norm_by_std)
    assert out32.dtype == torch.float32
    _assert_close(out32, want, 1e-5)
    assert out32[6].item() == 0.0  # group of one


def test_grpo_hand_cases():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 3.0, 3.0])
    ids = torch.tensor([0, 0, 0, 0, 1, 2, 2])
    adv = compute_grpo_advantages(scores, ids, eps=0.0)
    s = math.sqrt(3.0) / 2.0  # 0.5 / sqrt(1/3)
    assert adv.tolist() == pytest.approx([s, -s, -s, s, 0.0, 0.0, 0.0])
    adv = compute_grpo_advantages(scores, ids, norm_by_std=False)
    assert adv.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0])
    adv = compute_grpo_advantages(torch.tensor([2.0, 0.0]), torch.tensor([5, 5]), eps=1.0)
    assert adv.tolist() == pytest.approx([1 / (math.sqrt(2) + 1), -1 / (math.sqrt(2) + 1)])


def test_rloo_matches_reference():
    scores = torch.randn(len(IDS), generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want = ref_group_adv(scores.tolist(), IDS.tolist(), "rloo")
    _assert_close(compute_rloo_advantages(scores, IDS), want, 1e-12)
    out32 = compute_rloo_advantages(scores.float(), IDS)
    assert out32.dtype == torch.float32
    _assert_close(out32, want, 1e-5)


def test_rloo_hand_case():
    adv = compute_rloo_advantages(torch.tensor([1.0, 2.0, 3.0, 9.0]), torch.tensor([4, 4, 4, 8]))
    assert adv.tolist() == pytest.approx([-1.5, 0.0, 1.5, 0.0])


@pytest.mark.parametrize("fn", [compute_grpo_advantages, compute_rloo_advantages])
def test_group_of_equal_float_scores_gets_exactly_zero(fn):
    # 0.1 * 3 / 3 != 0.1 in floating point: a rounded mean must not turn into an O(1) advantage
    scores = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1])
    kwargs = {"eps": 0.0} if fn is compute_grpo_advantages else {}
    assert torch.equal(fn(scores, ids, **kwargs), torch.zeros(9, dtype=torch.float64))
    assert torch.equal(fn(scores.float(), ids, **kwargs), torch.zeros(9))


def test_integer_and_bool_scores_become_float32():
    ids = torch.tensor([0, 0, 1, 1])
    adv = compute_rloo_advantages(torch.tensor([1, 0, 1, 1]), ids)
    assert adv.dtype == torch.float32 and adv.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])


def test_place_score_on_last_token():
    scores = torch.tensor([1.5, -2.0, 3.0, 4.0, 0.25], dtype=torch.float64)
    out = place_score_on_last_token(scores, MASK)
    want = torch.zeros(MASK.shape, dtype=torch.float64)
    for b in range(MASK.shape[0]):
        unmasked = [t for t in range(MASK.shape[1]) if MASK[b, t]]
        if unmasked:
            want[b, unmasked[-1]] = scores[b]
    assert torch.equal(out, want)
    assert out[2].abs().sum() == 0  # the empty row gets nothing
    assert place_score_on_last_token(scores.float(), MASK).dtype == torch.float32
    assert place_score_on_last_token(torch.tensor([True, False]), torch.ones(2, 3)).tolist() == [
        [0.0, 0.0, 1.0],
        [0.0, 0.0, 0.0],
    ]


def test_errors_name_the_argument():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"values has shape \(2, 4\) but token_rewards has shape \(2, 3\)"):
        compute_gae(x, torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="response_mask has shape"):
        compute_gae(x, x, torch.ones(3, 2), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"token_rewards has shape \(3,\); pass a \[batch, tokens\]"):
        compute_gae(torch.zeros(3), torch.zeros(3), torch.ones(3), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"gamma=1\.5 must be in \[0, 1\]"):
        compute_gae(x, x, x, 1.5, 1.0)
    with pytest.raises(ValueError, match=r"lam=-0\.1 must be in \[0, 1\]"):
        compute_gae(x, x, x, 1.0, -0.1)
    with pytest.raises(ValueError, match=r"gamma=2 must be in \[0, 1\]"):
        compute_reinforce_pp_returns(x, x, 2)
    with pytest.raises(ValueError, match="response_mask has shape"):
        compute_reinforce_pp_returns(x, torch.ones(2, 2), 1.0)
    with pytest.raises(ValueError, match=r"group_ids has shape \(3,\) but scores has shape \(4,\)"):
        compute_grpo_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="group_ids have dtype torch.float32; pass an integer tensor"):
        compute_rloo_advantages(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match=r"scores has shape \(4, 1\); pass one score per sample"):
        compute_grpo_advantages(torch.zeros(4, 1), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"scores\[2\] = nan is not finite"):
        compute_grpo_advantages(torch.tensor([0.0, 1.0, float("nan")]), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"eps=-1 must be >= 0"):
        compute_grpo_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), eps=-1)
    with pytest.raises(ValueError, match=r"scores has shape \(3,\) but response_mask has shape \(2, 5\)"):
        place_score_on_last_token(torch.zeros(3), torch.ones(2, 5))
