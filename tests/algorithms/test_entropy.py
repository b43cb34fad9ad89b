"""Entropy control (float64): the adaptive coefficient, the high-entropy token mask (arXiv 2506.01939) and
the sync-free quantiles, each against a plain-Python computation written here."""

from __future__ import annotations

import math

import pytest
import torch

from verl.algorithms import AdaptiveEntropyController, masked_quantiles, top_entropy_mask


def _data(seed=0, shape=(4, 9)):
    g = torch.Generator().manual_seed(seed)
    entropy = torch.rand(shape, generator=g, dtype=torch.float64) * 3
    mask = (torch.rand(shape, generator=g) > 0.3).double()
    mask[0] = 0  # an empty response
    return entropy, mask


@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.05, 1.0])
def test_top_entropy_mask_keeps_the_highest_fraction_of_unmasked_tokens(fraction):
    entropy, mask = _data()
    got = top_entropy_mask(entropy, mask, fraction)
    valid = [(float(e), i) for i, (e, m) in enumerate(zip(entropy.flatten(), mask.flatten(), strict=True)) if m]
    k = math.ceil(len(valid) * fraction)
    chosen = {i for _, i in sorted(valid, reverse=True)[:k]}
    want = torch.tensor([1.0 if i in chosen else 0.0 for i in range(entropy.numel())], dtype=torch.float64)
    assert got.dtype == torch.float64
    assert torch.equal(got.flatten(), want)
    assert float((got * (1 - mask)).abs().sum()) == 0  # never a masked token


def test_top_entropy_mask_keeps_ties_and_survives_no_tokens():
    entropy = torch.tensor([[1.0, 2.0, 2.0, 0.5]], dtype=torch.float64)
    mask = torch.ones_like(entropy)
    assert top_entropy_mask(entropy, mask, 0.25).tolist() == [[0.0, 1.0, 1.0, 0.0]]  # 1 asked, tie at 2.0
    assert top_entropy_mask(entropy, torch.zeros_like(entropy), 0.2).sum() == 0
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        top_entropy_mask(entropy, mask, 0.0)


def test_masked_quantiles_match_torch_quantile_of_the_unmasked_tokens():
    entropy, mask = _data(1)
    qs = (0.1, 0.5, 0.9, 0.0, 1.0)
    got = masked_quantiles(entropy, mask, qs)
    want = torch.quantile(entropy[mask.bool()], torch.tensor(qs, dtype=torch.float64))
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert masked_quantiles(entropy, torch.zeros_like(mask), qs).tolist() == [0.0] * len(qs)
    one = torch.zeros_like(mask)
    one[1, 2] = 1
    assert masked_quantiles(entropy, one, qs).tolist() == [float(entropy[1, 2])] * len(qs)


def test_adaptive_entropy_coefficient_steers_towards_the_target_and_stays_in_bounds():
    ctrl = AdaptiveEntropyController(0.0, target=1.0, step_size=0.01, max_coef=0.05)
    want = 0.0
    for h in [0.2, 0.4, 0.9, 1.5, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]:
        want = min(max(want + 0.01 * (1.0 - h), 0.0), 0.05)
        assert ctrl.update(torch.tensor(h, dtype=torch.float64)) == pytest.approx(want, abs=1e-15)
    assert ctrl.value == 0.05  # collapsed entropy: the bonus rises to its bound, no further
    for _ in range(20):
        ctrl.update(2.0)
    assert ctrl.value == 0.0  # entropy above the target: the bonus goes back to 0, not below


def test_adaptive_entropy_state_resumes_exactly():
    a = AdaptiveEntropyController(0.001, target=0.8, step_size=0.003, max_coef=1.0)
    for h in [0.1, 0.3, 0.35]:
        a.update(h)
    b = AdaptiveEntropyController(0.001, target=0.8, step_size=0.003, max_coef=1.0)
    b.load_state_dict(a.state_dict())
    for h in [0.2, 0.6]:
        assert a.update(h) == b.update(h)
    with pytest.raises(ValueError, match="target"):
        AdaptiveEntropyController(0.0, target=0.0, step_size=0.01, max_coef=1.0)
    with pytest.raises(ValueError, match="not finite"):
        a.update(float("nan"))
