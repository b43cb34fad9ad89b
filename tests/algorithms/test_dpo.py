"""DPO losses against plain-Python float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from verl.algorithms import DPO_LOSS_TYPES, dpo_loss


def log_sigmoid(z: float) -> float:
    return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))


def ref_dpo(pc, pr, rc, rr, beta, loss_type, ls):
    d = (pc - rc) - (pr - rr)
    if loss_type == "sigmoid":
        loss = -(1 - ls) * log_sigmoid(beta * d) - ls * log_sigmoid(-beta * d)
    elif loss_type == "ipo":
        loss = (d - 1 / (2 * beta)) ** 2
    else:
        loss = max(0.0, 1 - beta * d)
    return loss, beta * (pc - rc), beta * (pr - rr)


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, generator=g, dtype=torch.float64) * 20 - 50).to(dtype) for _ in range(4)]


@pytest.mark.parametrize(
    "loss_type,beta,ls",
    [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.2), ("ipo", 0.1, 0.0), ("hinge", 0.05, 0.0)],
)
def test_dpo_matches_reference(loss_type, beta, ls):
    pc, pr, rc, rr = _inputs()
    losses, ch, rj = dpo_loss(pc, pr, rc, rr, beta, loss_type, ls)
    l32, c32, r32 = dpo_loss(*_inputs(torch.float32), beta, loss_type, ls)
    assert l32.dtype == c32.dtype == r32.dtype == torch.float32
    for i in range(16):
        want = ref_dpo(pc[i].item(), pr[i].item(), rc[i].item(), rr[i].item(), beta, loss_type, ls)
        assert (losses[i].item(), ch[i].item(), rj[i].item()) == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert (l32[i].item(), c32[i].item(), r32[i].item()) == pytest.approx(want, rel=1e-4, abs=1e-4)
    if loss_type == "hinge":
        assert (losses == 0).any() and (losses > 0).any()  # both sides of the hinge are exercised


def test_dpo_hand_cases():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-10.0, -12.0, -11.0, -11.0))  # d = 1 - (-1) = 2
    losses, ch, rj = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert losses.item() == pytest.approx(math.log1p(math.exp(-1.0)))
    assert ch.item() == pytest.approx(0.5) and rj.item() == pytest.approx(-0.5)
    losses, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.5)
    assert losses.item() == pytest.approx(0.5 * math.log1p(math.exp(-1.0)) + 0.5 * math.log1p(math.exp(1.0)))
    assert dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type="ipo")[0].item() == pytest.approx(1.0)  # (2 - 1)^2
    assert dpo_loss(pc, pr, rc, rr, beta=0.25, loss_type="hinge")[0].item() == pytest.approx(0.5)
    assert dpo_loss(pc, pr, rc, rr, beta=1.0, loss_type="hinge")[0].item() == 0.0


def test_dpo_sigmoid_is_stable_for_large_margins():
    big = torch.tensor([1e4])
    zero = torch.zeros(1)
    losses, _, _ = dpo_loss(zero, big, zero, zero, beta=1.0)  # d = -1e4: loss ~ 1e4, not inf
    assert losses.item() == pytest.approx(1e4)
    assert dpo_loss(big, zero, zero, zero, beta=1.0)[0].item() == pytest.approx(0.0, abs=1e-30)


def test_dpo_gradient_reaches_policy_only():
    pc, pr, rc, rr = (t.clone().requires_grad_(True) for t in _inputs())
    losses, ch, rj = dpo_loss(pc, pr, rc, rr, beta=0.1)
    losses.sum().backward()
    assert not ch.requires_grad and not rj.requires_grad
    assert rc.grad is None and rr.grad is None
    # d loss / d pc = -beta * sigmoid(-beta d); d loss / d pr = +beta * sigmoid(-beta d)
    d = (pc - rc - pr + rr).detach()
    want = -0.1 * torch.sigmoid(-0.1 * d)
    assert torch.allclose(pc.grad, want) and torch.allclose(pr.grad, -want)


def test_errors_name_the_argument():
    x = torch.zeros(4)
    with pytest.raises(
        ValueError, match=r"ref_rejected_logps has shape \(3,\) but policy_chosen_logps has shape \(4,\)"
    ):
        dpo_loss(x, x, x, torch.zeros(3), 0.1)
    with pytest.raises(ValueError, match="beta=0 must be > 0"):
        dpo_loss(x, x, x, x, 0)
    with pytest.raises(ValueError, match="loss_type='kto' is not a DPO loss; use one of sigmoid, ipo, hinge"):
        dpo_loss(x, x, x, x, 0.1, loss_type="kto")
    with pytest.raises(ValueError, match=r"label_smoothing=0\.7 must be in \[0, 0\.5\]"):
        dpo_loss(x, x, x, x, 0.1, label_smoothing=0.7)
    with pytest.raises(
        ValueError, match=r"label_smoothing=0\.1 only applies to loss_type='sigmoid', not 'ipo'"
    ):
        dpo_loss(x, x, x, x, 0.1, loss_type="ipo", label_smoothing=0.1)
    assert set(DPO_LOSS_TYPES) == {"sigmoid", "ipo", "hinge"}
