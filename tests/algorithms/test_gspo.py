"""GSPO's sequence-level importance ratio against its objective written out per response in float64."""

from __future__ import annotations

import pytest
import torch

from verl.algorithms import ppo_policy_loss


def gspo_reference(logp, old, adv, mask, low, high):
    """1/G sum_i max(-A_i s_i, -A_i clip(s_i, 1 - low, 1 + high)), s_i = exp(mean_t(logp - old)) over response i."""
    losses = []
    for i in range(logp.shape[0]):
        m = mask[i].bool()
        s = torch.exp((logp[i][m] - old[i][m]).mean())
        a = adv[i][m][0]
        losses.append(torch.maximum(-a * s, -a * s.clamp(1 - low, 1 + high)))
    return torch.stack(losses).mean()


@pytest.mark.parametrize("low, high", [(3e-4, 4e-4), (0.2, 0.28)])
def test_sequence_ratio_is_gspos_objective_and_gradient(low, high):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 7
    mask = torch.ones(B, T)
    for i, length in enumerate([7, 3, 5, 1, 6, 4]):
        mask[i, length:] = 0
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.05).requires_grad_(True)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()  # one advantage a response
    loss, metrics = ppo_policy_loss(logp, old, adv, mask, clip_low=low, clip_high=high, agg="seq-mean-token-mean",
                                    sequence_ratio=True)
    (grad,) = torch.autograd.grad(loss, logp)
    ref_logp = logp.detach().clone().requires_grad_(True)
    want = gspo_reference(ref_logp, old, adv, mask, low, high)
    (want_grad,) = torch.autograd.grad(want, ref_logp)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    assert grad[mask == 0].abs().max() == 0
    if low < 0.01:  # tiny ranges: some responses are clipped, and a response is clipped as a whole
        assert 0 < metrics["clipfrac"] < 1


def test_token_and_sequence_ratio_agree_at_one_token_responses():
    g = torch.Generator().manual_seed(1)
    logp, noise, adv = (torch.randn(5, 1, generator=g, dtype=torch.float64) for _ in range(3))
    old, mask = logp + 0.1 * noise, torch.ones(5, 1)
    token, _ = ppo_policy_loss(logp, old, adv, mask)
    sequence, _ = ppo_policy_loss(logp, old, adv, mask, sequence_ratio=True)
    torch.testing.assert_close(token, sequence)
