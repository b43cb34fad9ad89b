"""Rollout correction against the formulas written out per token with Python floats (float64)."""

import math

import pytest
import torch

from verl.algorithms.rollout_correction import rollout_correction

# two responses: 3 tokens and 2 tokens (the third position is padding, with a junk log-prob)
PROX = [[-1.0, -0.5, -0.1], [-0.2, -3.0, 0.0]]
BEHAV = [[-1.5, -0.4, -2.0], [-0.2, -1.0, -float("inf")]]
MASK = [[1, 1, 1], [1, 1, 0]]


def _run(mode, **kw):
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return rollout_correction(t(PROX), t(BEHAV), t(MASK), mode, **kw)


def _tokens():
    return [[(p, b) for p, b, k in zip(pr, br, kr, strict=True) if k]
            for pr, br, kr in zip(PROX, BEHAV, MASK, strict=True)]


def _ratios():
    return [[math.exp(p - b) for p, b in row] for row in _tokens()]


def _padded(rows):
    return [row + [0.0] * (3 - len(row)) for row in rows]


def _assert_close(tensor, expected):
    assert tensor.dtype == torch.float64
    torch.testing.assert_close(tensor, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_token_tis_is_the_ratio_truncated_at_the_cap_per_token():
    out = _run("token_tis", cap=1.5)
    expected = [[min(r, 1.5) for r in row] for row in _ratios()]
    _assert_close(out.weights, _padded(expected))
    assert out.keep.tolist() == [[True, True, True], [True, True, False]]
    flat = [r for row in _ratios() for r in row]
    assert out.metrics["truncated_frac"].item() == pytest.approx(sum(r >= 1.5 for r in flat) / 5)
    assert out.metrics["masked_frac"].item() == 0.0
    assert out.metrics["weight_mean"].item() == pytest.approx(sum(min(r, 1.5) for r in flat) / 5, rel=1e-12)


def test_seq_tis_uses_the_product_of_the_ratios_and_seq_tis_geo_their_geometric_mean():
    products = [math.prod(row) for row in _ratios()]
    geo = [math.prod(row) ** (1 / len(row)) for row in _ratios()]
    cap = 3.0
    _assert_close(_run("seq_tis", cap=cap).weights,
                  _padded([[min(p, cap)] * n for p, n in zip(products, (3, 2), strict=True)]))
    _assert_close(_run("seq_tis_geo", cap=cap).weights,
                  _padded([[min(g, cap)] * n for g, n in zip(geo, (3, 2), strict=True)]))
    assert products[0] > cap > geo[0]  # the first response is truncated as a product, not as a mean
    assert _run("seq_tis", cap=cap).metrics["truncated_frac"].item() == pytest.approx(3 / 5)


def test_a_product_over_a_long_response_does_not_overflow():
    n = 2000
    prox, behav = torch.zeros(1, n, dtype=torch.float64), torch.full((1, n), -1.0, dtype=torch.float64)
    out = rollout_correction(prox, behav, torch.ones(1, n), "seq_tis", cap=2.0)
    assert torch.equal(out.weights, torch.full((1, n), 2.0, dtype=torch.float64))


def test_token_mask_rejects_tokens_whose_ratio_leaves_the_band():
    out = _run("token_mask", lo=0.5, hi=2.0)
    keep = [[0.5 <= r <= 2.0 for r in row] for row in _ratios()]
    assert out.keep.tolist() == [row + [False] * (3 - len(row)) for row in keep]
    _assert_close(out.weights, _padded([[1.0 if k else 0.0 for k in row] for row in keep]))
    rejected = sum(not k for row in keep for k in row)
    assert rejected > 0 and out.metrics["masked_frac"].item() == pytest.approx(rejected / 5)


def test_seq_mask_rejects_whole_responses_by_their_geometric_mean_ratio():
    geo = [math.prod(row) ** (1 / len(row)) for row in _ratios()]
    lo, hi = 0.05, 1.2
    out = _run("seq_mask", lo=lo, hi=hi)
    keep = [lo <= g <= hi for g in geo]
    assert keep == [False, True]  # the data is chosen so that one response goes, one stays
    assert out.keep.tolist() == [[False] * 3, [True, True, False]]
    assert out.metrics["masked_frac"].item() == pytest.approx(3 / 5)


def test_ratio_and_kl_metrics():
    out = _run("token_tis", cap=2.0)
    flat = [r for row in _ratios() for r in row]
    logs = [p - b for row in _tokens() for p, b in row]
    m = out.metrics
    assert m["ratio_mean"].item() == pytest.approx(sum(flat) / 5, rel=1e-12)
    assert m["ratio_max"].item() == pytest.approx(max(flat), rel=1e-12)
    assert m["ratio_min"].item() == pytest.approx(min(flat), rel=1e-12)
    assert m["kl_k1"].item() == pytest.approx(sum(-x for x in logs) / 5, rel=1e-12)
    assert m["kl_k3"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x in logs) / 5, rel=1e-12)
    assert all(v.dim() == 0 for v in m.values())


def test_equal_policies_give_unit_weights_and_zero_kl():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    for mode in ("token_tis", "seq_tis", "seq_tis_geo", "token_mask", "seq_mask"):
        out = rollout_correction(lp, lp.clone(), torch.ones(1, 2), mode)
        assert torch.equal(out.weights, torch.ones(1, 2, dtype=torch.float64))
        assert out.metrics["kl_k3"].item() == 0.0 and out.metrics["masked_frac"].item() == 0.0


def test_unknown_or_off_mode_is_refused():
    with pytest.raises(ValueError, match="token_tis"):
        _run("off")
    with pytest.raises(ValueError, match="seq_mask"):
        _run("tis")
