"""Masked statistics and loss aggregation against plain-Python float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from verl.algorithms import (
    AGG_MODES,
    aggregate_loss,
    explained_variance,
    masked_mean,
    masked_moments,
    masked_var,
    masked_whiten,
    whiten_from_moments,
)

# Rows: full, a gap in the middle plus end padding, empty, left and right padding.
MASK = torch.tensor(
    [
        [1, 1, 1, 1, 1, 1],
        [1, 1, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
    ]
)


def _x(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(MASK.shape, generator=g, dtype=torch.float64) * 3 + 1


def ref_mean(x, mask):
    vals = [float(v) for v, m in zip(x.flatten().tolist(), mask.flatten().tolist(), strict=True) if m]
    return sum(vals) / len(vals) if vals else 0.0


def ref_var(x, mask, unbiased=True):
    vals = [float(v) for v, m in zip(x.flatten().tolist(), mask.flatten().tolist(), strict=True) if m]
    mu = sum(vals) / len(vals)
    dof = len(vals) - 1 if unbiased else len(vals)
    return sum((v - mu) ** 2 for v in vals) / dof


def ref_agg(loss, mask, mode, norm_len=None):
    rows = [
        [float(v) for v, m in zip(lr, mr, strict=True) if m]
        for lr, mr in zip(loss.tolist(), mask.tolist(), strict=True)
    ]
    if mode == "token-mean":
        flat = [v for r in rows for v in r]
        return sum(flat) / len(flat) if flat else 0.0
    per_seq = []
    for r in rows:
        if not r:
            continue
        if mode == "seq-mean-token-mean":
            per_seq.append(sum(r) / len(r))
        elif mode == "seq-mean-token-sum":
            per_seq.append(sum(r))
        else:
            per_seq.append(sum(r) / (norm_len if norm_len is not None else loss.shape[-1]))
    return sum(per_seq) / len(per_seq) if per_seq else 0.0


def test_masked_mean_matches_reference_all_and_per_row():
    x = _x()
    assert masked_mean(x, MASK).item() == pytest.approx(ref_mean(x, MASK), abs=1e-12)
    per_row = masked_mean(x, MASK, dim=1)
    for i in range(MASK.shape[0]):
        assert per_row[i].item() == pytest.approx(ref_mean(x[i], MASK[i]), abs=1e-12)
    assert per_row[2].item() == 0.0  # the empty row


def test_masked_mean_hand_case_and_dtype():
    x = torch.tensor([1.0, 2.0, 100.0, 4.0])
    out = masked_mean(x, torch.tensor([True, True, False, True]))
    assert out.dtype == torch.float32
    assert out.item() == pytest.approx(7.0 / 3.0)


def test_nan_under_mask_does_not_leak_into_values_or_gradients():
    x = _x().clone()
    x[1, 2] = float("nan")
    x[3, 5] = float("inf")
    x.requires_grad_(True)
    total = masked_mean(x, MASK) + masked_var(x, MASK) + masked_whiten(x, MASK).sum()
    total.backward()
    assert torch.isfinite(total)
    assert torch.isfinite(x.grad).all()
    assert x.grad[1, 2] == 0 and x.grad[3, 5] == 0


@pytest.mark.parametrize("unbiased", [True, False])
def test_masked_var_matches_reference(unbiased):
    x = _x(1)
    assert masked_var(x, MASK, unbiased=unbiased).item() == pytest.approx(
        ref_var(x, MASK, unbiased), rel=1e-12
    )
    out32 = masked_var(x.float(), MASK, unbiased=unbiased)
    assert out32.dtype == torch.float32
    assert out32.item() == pytest.approx(ref_var(x, MASK, unbiased), rel=1e-5)


def test_masked_var_hand_case_and_degenerate_counts():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    m = torch.tensor([1, 1, 1, 0])
    assert masked_var(x, m).item() == pytest.approx(1.0)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(2.0 / 3.0)
    assert masked_var(x, torch.tensor([0, 1, 0, 0])).item() == 0.0
    assert masked_var(x, torch.zeros(4)).item() == 0.0


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_reference(shift_mean):
    x = _x(2)
    eps = 1e-8
    mu, var = ref_mean(x, MASK), ref_var(x, MASK)
    out = masked_whiten(x, MASK, shift_mean=shift_mean, eps=eps)
    out32 = masked_whiten(x.float(), MASK, shift_mean=shift_mean, eps=eps)
    assert out32.dtype == torch.float32
    for i in range(MASK.shape[0]):
        for j in range(MASK.shape[1]):
            if MASK[i, j]:
                want = (x[i, j].item() - mu) / math.sqrt(var + eps) + (0.0 if shift_mean else mu)
            else:
                want = 0.0
            assert out[i, j].item() == pytest.approx(want, abs=1e-12)
            assert out32[i, j].item() == pytest.approx(want, abs=1e-5)


def test_masked_whiten_hand_case():
    out = masked_whiten(torch.tensor([1.0, 2.0, 3.0, 50.0]), torch.tensor([1, 1, 1, 0]), eps=0.0)
    assert out.tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0])
    out = masked_whiten(torch.tensor([1.0, 2.0, 3.0]), torch.ones(3), shift_mean=False, eps=0.0)
    assert out.tolist() == pytest.approx([1.0, 2.0, 3.0])
    out = masked_whiten(torch.tensor([2.0, 4.0, 6.0]), torch.ones(3), shift_mean=False, eps=0.0)
    assert out.tolist() == pytest.approx([3.0, 4.0, 5.0])  # (x - 4) / 2 + 4


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_loss_matches_reference(mode):
    loss = _x(3)
    out = aggregate_loss(loss, MASK, mode)
    assert out.item() == pytest.approx(ref_agg(loss, MASK, mode), abs=1e-12)
    out32 = aggregate_loss(loss.float(), MASK.bool(), mode)
    assert out32.dtype == torch.float32
    assert out32.item() == pytest.approx(ref_agg(loss, MASK, mode), abs=1e-5)


def test_aggregate_loss_hand_cases():
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(20.0 / 5.0)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.5 + 10.0) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((10.0 + 10.0) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((2.5 + 2.5) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=10).item() == pytest.approx(1.0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_loss_all_masked_is_zero_and_differentiable(mode):
    loss = torch.randn(2, 3, requires_grad=True)
    out = aggregate_loss(loss, torch.zeros(2, 3), mode)
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(loss.grad, torch.zeros(2, 3))


def test_aggregate_loss_gradient_is_weight_per_token():
    loss = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    aggregate_loss(loss, mask, "seq-mean-token-mean").backward()
    assert loss.grad.flatten().tolist() == pytest.approx([0.125] * 4 + [0.5, 0, 0, 0])


def test_explained_variance_matches_reference():
    returns, values = _x(4), _x(5)
    got = explained_variance(values, returns, MASK)
    diff = returns - values
    want = 1 - ref_var(diff, MASK) / ref_var(returns, MASK)
    assert got.item() == pytest.approx(want, rel=1e-12)
    assert explained_variance(values.float(), returns.float(), MASK).dtype == torch.float32


def test_explained_variance_hand_cases():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0])
    m = torch.ones(4)
    assert explained_variance(r, r, m).item() == pytest.approx(1.0)
    assert explained_variance(torch.full((4,), 2.5), r, m).item() == pytest.approx(0.0)
    # values off by a constant explain everything
    assert explained_variance(r + 7, r, m).item() == pytest.approx(1.0)
    # constant returns: undefined ratio -> 0, never NaN
    assert explained_variance(r, torch.ones(4), m).item() == 0.0


def test_errors_name_the_argument():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"mask has shape \(3, 2\) but x has shape \(2, 3\)"):
        masked_mean(x, torch.ones(3, 2))
    with pytest.raises(ValueError, match="mask has shape"):
        masked_var(x, torch.ones(3))
    with pytest.raises(ValueError, match=r"eps=-1\.0 must be >= 0"):
        masked_whiten(x, torch.ones(2, 3), eps=-1.0)
    with pytest.raises(ValueError, match="mode='mean' is not a loss aggregation mode; use one of token-mean"):
        aggregate_loss(x, torch.ones(2, 3), "mean")
    with pytest.raises(ValueError, match="mask has shape .* but loss_mat has shape"):
        aggregate_loss(x, torch.ones(2, 4), "token-mean")
    with pytest.raises(ValueError, match="norm_len=0 must be > 0"):
        aggregate_loss(x, torch.ones(2, 3), "seq-mean-token-sum-norm", norm_len=0)
    with pytest.raises(ValueError, match="returns has shape"):
        explained_variance(x, torch.zeros(3), torch.ones(2, 3))


def test_whitening_from_summed_moments_equals_whitening_the_whole_batch():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 9, generator=g, dtype=torch.float64) * 3 + 2
    mask = (torch.rand(6, 9, generator=g) > 0.3).long()
    shards = [(x[:2], mask[:2]), (x[2:], mask[2:])]
    moments = sum(masked_moments(xs, ms) for xs, ms in shards)
    got = torch.cat([whiten_from_moments(xs, ms, moments) for xs, ms in shards])
    vals = [x[i, j].item() for i in range(6) for j in range(9) if mask[i, j]]
    mean = sum(vals) / len(vals)
    std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
    want = torch.tensor([[(x[i, j].item() - mean) / std if mask[i, j] else 0.0 for j in range(9)]
                         for i in range(6)], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=0, atol=1e-7)  # eps=1e-8 inside the sqrt
    assert torch.allclose(got, masked_whiten(x, mask), rtol=0, atol=1e-12)  # 1 rank == 2 shards
