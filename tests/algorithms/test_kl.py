"""KL estimators and KL coefficient controllers."""

from __future__ import annotations

import math

import pytest
import torch

from verl.algorithms import KL_KINDS, AdaptiveKLController, FixedKLController, kl_penalty, sequence_kl_sums


def ref_kl(lp: float, ref: float, kind: str) -> float:
    if kind == "k1":
        return lp - ref
    if kind == "k2":
        return 0.5 * (lp - ref) ** 2
    if kind == "k3":
        x = min(max(ref - lp, -20.0), 20.0)
        return min(max(math.exp(x) - x - 1, -10.0), 10.0)
    return abs(lp - ref)


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_penalty_matches_reference(kind):
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(3, 5, generator=g, dtype=torch.float64) * 2
    ref = torch.randn(3, 5, generator=g, dtype=torch.float64) * 2
    got = kl_penalty(lp, ref, kind)
    got32 = kl_penalty(lp.float(), ref.float(), kind)
    assert got32.dtype == torch.float32 and got.shape == (3, 5)
    for i in range(3):
        for j in range(5):
            want = ref_kl(lp[i, j].item(), ref[i, j].item(), kind)
            assert got[i, j].item() == pytest.approx(want, rel=1e-12, abs=1e-12)
            assert got32[i, j].item() == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_kl_penalty_hand_case():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-1.0))  # e^-1 + 1 - 1
    assert kl_penalty(ref, lp, "abs").item() == pytest.approx(1.0)


def test_k3_is_accurate_for_tiny_differences_in_float32():
    lp = torch.tensor([-1.0001], dtype=torch.float32)
    ref = torch.tensor([-1.0], dtype=torch.float32)
    x = ref.double().item() - lp.double().item()  # the float32 inputs' exact difference
    want = math.expm1(x) - x  # ~ x^2 / 2 = 5e-9
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(want, rel=1e-3)


def test_k3_gradient():
    lp = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.1, 0.2], dtype=torch.float64)
    kl_penalty(lp, ref, "k3").sum().backward()
    want = [1 - math.exp(r - p) for p, r in zip(lp.tolist(), ref.tolist(), strict=True)]
    assert lp.grad.tolist() == pytest.approx(want)


def test_fixed_controller_never_moves():
    c = FixedKLController(0.05)
    c.update(10.0, 100)
    c.update(torch.tensor(0.0), 3)
    assert c.value == 0.05
    other = FixedKLController(1.0)
    other.load_state_dict(c.state_dict())
    assert other.value == 0.05


def test_adaptive_controller_matches_reference_sequence():
    kls = [0.05, 0.2, 0.1, 0.0, 1.0, 0.12, 0.09]
    steps = [64, 128, 64, 32, 256, 64, 64]
    c = AdaptiveKLController(0.1, target=0.1, horizon=1000)
    want = 0.1
    for kl, n in zip(kls, steps, strict=True):
        c.update(kl, n)
        err = min(max(kl / 0.1 - 1, -0.2), 0.2)
        want *= 1 + err * n / 1000
        assert c.value == pytest.approx(want, rel=1e-15)


def test_adaptive_controller_hand_case():
    c = AdaptiveKLController(1.0, target=1.0, horizon=10)
    c.update(5.0, 5)  # error clipped to 0.2: 1 * (1 + 0.2 * 5 / 10)
    assert c.value == pytest.approx(1.1)
    c.update(torch.tensor(0.95), 10)  # error -0.05: 1.1 * (1 - 0.05)
    assert c.value == pytest.approx(1.045)


def test_adaptive_controller_resume_is_exact():
    kls = [0.3, 0.01, 0.2, 0.07, 0.15, 0.11]
    full = AdaptiveKLController(0.2, 0.1, 500)
    for kl in kls:
        full.update(kl, 37)
    first = AdaptiveKLController(0.2, 0.1, 500)
    for kl in kls[:3]:
        first.update(kl, 37)
    state = first.state_dict()
    assert state == {"value": first.value, "target": 0.1, "horizon": 500.0}
    resumed = AdaptiveKLController(0.2, 0.1, 500)
    resumed.load_state_dict(state)
    for kl in kls[3:]:
        resumed.update(kl, 37)
    assert resumed.value == full.value  # bit for bit


def test_errors_name_the_argument():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="kind='kl' is not a KL estimator; use one of k1, k2, k3, abs"):
        kl_penalty(x, x, "kl")
    with pytest.raises(ValueError, match=r"ref_logprob has shape \(2,\) but logprob has shape \(3,\)"):
        kl_penalty(x, torch.zeros(2), "k1")
    with pytest.raises(ValueError, match=r"coef=-0\.1 must be a finite number >= 0"):
        FixedKLController(-0.1)
    with pytest.raises(ValueError, match="init_coef=nan must be a finite number"):
        AdaptiveKLController(float("nan"), 0.1, 10)
    with pytest.raises(ValueError, match="target=0 must be > 0"):
        AdaptiveKLController(0.1, 0, 10)
    with pytest.raises(ValueError, match="horizon=0 must be > 0"):
        AdaptiveKLController(0.1, 0.1, 0)
    c = AdaptiveKLController(0.1, 0.1, 10)
    with pytest.raises(ValueError, match="current_kl=nan is not finite"):
        c.update(float("nan"), 1)
    with pytest.raises(ValueError, match="n_steps=-1 must be >= 0"):
        c.update(0.1, -1)
    with pytest.raises(ValueError, match="current_kl=inf is not finite"):
        FixedKLController(0.1).update(torch.tensor(float("inf")), 1)
    with pytest.raises(ValueError, match="state for AdaptiveKLController.load_state_dict has no 'value' key"):
        c.load_state_dict({"coef": 0.1})
    with pytest.raises(ValueError, match=r"state\['value'\]=-1\.0 for FixedKLController must be"):
        FixedKLController(0.1).load_state_dict({"value": -1.0})
    assert c.value == 0.1  # failed calls changed nothing


def test_k3_is_clamped_and_its_gradient_stays_finite():
    lp = torch.tensor([-30.0, -5.0, -1.0], requires_grad=True)  # ref - lp = 29 (overflows exp in float32), 4, 0
    ref = torch.tensor([-1.0, -1.0, -1.0])
    kl = kl_penalty(lp, ref, "k3")
    assert kl.tolist() == pytest.approx([10.0, 10.0, 0.0])  # e^4 - 4 - 1 = 49.6 -> 10
    kl.sum().backward()
    assert torch.isfinite(lp.grad).all() and lp.grad.tolist() == pytest.approx([0.0, 0.0, 0.0])
    many = torch.full((1, 64), -1.0)
    one_extreme = many.clone()
    one_extreme[0, 0] = -40.0
    assert float(kl_penalty(one_extreme, many * 0 - 1, "k3").mean()) <= 10.0 / 64 + 1e-6


def test_sequence_kl_sums_is_the_mean_of_per_sequence_token_means():
    g = torch.Generator().manual_seed(3)
    kl = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 7, generator=g) > 0.4).long()
    mask[2] = 0  # an empty response is not counted
    total, count = sequence_kl_sums(kl, mask).tolist()
    means = [sum(kl[i, j].item() for j in range(7) if mask[i, j]) / int(mask[i].sum())
             for i in range(5) if mask[i].sum() > 0]
    assert count == len(means) == 4
    assert total / count == pytest.approx(sum(means) / len(means), rel=1e-12)
    halves = sequence_kl_sums(kl[:3], mask[:3]) + sequence_kl_sums(kl[3:], mask[3:])
    assert torch.allclose(halves, sequence_kl_sums(kl, mask), rtol=0, atol=1e-12)
