"""The Bradley–Terry reward-model loss against a plain-Python float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from verl.algorithms import bradley_terry_loss


def ref_loss(rc: float, rr: float, margin: float, coef: float) -> float:
    z = rc - rr - margin
    nll = math.log1p(math.exp(-z)) if z >= 0 else -z + math.log1p(math.exp(z))  # -log sigmoid(z)
    return nll + coef * (rc + rr) ** 2


def _inputs(dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # rewards far apart on both sides, so the stable branches of -log sigmoid are both exercised
    return [(torch.randn(32, generator=g, dtype=torch.float64) * 30).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("with_margin,coef", [(False, 0.0), (True, 0.0), (False, 0.01), (True, 0.5)])
def test_matches_float64_reference(with_margin, coef):
    rc, rr, m = _inputs()
    losses = bradley_terry_loss(rc, rr, m if with_margin else None, coef)
    l32 = bradley_terry_loss(*[t.float() for t in (rc, rr)], m.float() if with_margin else None, coef)
    assert losses.dtype == torch.float64 and l32.dtype == torch.float32
    for i in range(32):
        want = ref_loss(rc[i].item(), rr[i].item(), m[i].item() if with_margin else 0.0, coef)
        assert losses[i].item() == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert l32[i].item() == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert torch.isfinite(losses).all()


def test_hand_cases_and_gradient():
    rc = torch.tensor([0.0, 2.0, -1.0], dtype=torch.float64, requires_grad=True)
    rr = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64, requires_grad=True)
    losses = bradley_terry_loss(rc, rr, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64), 0.1)
    # equal rewards: log 2; a margin equal to the gap: log 2 plus the centring term 0.1 * 3^2
    assert losses.tolist() == pytest.approx([math.log(2), math.log(2) + 0.9, math.log1p(math.exp(2)) + 0.0])
    losses.sum().backward()
    # d/drc of -log sigmoid(z) is -sigmoid(-z); plus 2c (rc + rr)
    z = torch.tensor([0.0, 0.0, -2.0], dtype=torch.float64)
    centre = 2 * 0.1 * torch.tensor([0.0, 3.0, 0.0], dtype=torch.float64)
    torch.testing.assert_close(rc.grad, -torch.sigmoid(-z) + centre)
    torch.testing.assert_close(rr.grad, torch.sigmoid(-z) + centre)


def test_errors():
    with pytest.raises(ValueError, match="rejected_rewards has shape"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="margin has shape"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="center_coefficient=-1"):
        bradley_terry_loss(torch.zeros(3), torch.zeros(3), center_coefficient=-1.0)
