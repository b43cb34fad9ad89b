"""PPO policy loss and value loss against plain-Python float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from verl.algorithms import AGG_MODES, ppo_policy_loss, value_loss

MASK = torch.tensor(
    [
        [1, 1, 1, 1, 1, 1],
        [1, 1, 0, 0, 1, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
    ]
)


def _rand(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(MASK.shape, generator=g, dtype=torch.float64) * scale


def ref_agg(per_token, mask, mode):
    T = len(mask[0])
    rows = [[v for v, m in zip(r, mr, strict=True) if m] for r, mr in zip(per_token, mask, strict=True)]
    if mode == "token-mean":
        flat = [v for r in rows for v in r]
        return sum(flat) / len(flat)
    per_seq = []
    for r in rows:
        if r:
            per_seq.append(
                {"seq-mean-token-mean": sum(r) / len(r), "seq-mean-token-sum": sum(r)}.get(mode, sum(r) / T)
            )
    return sum(per_seq) / len(per_seq)


def ref_ppo(logp, old, adv, mask, clip_low, clip_high, dual_clip, mode):
    per_token, clipped, dual, kl, n = [], 0, 0, 0.0, 0
    for lr, orow, arow, mrow in zip(logp, old, adv, mask, strict=True):
        row = []
        for lp, o, a, m in zip(lr, orow, arow, mrow, strict=True):
            if not m:
                row.append(0.0)
                continue
            n += 1
            kl += o - lp
            r = math.exp(lp - o)
            l1 = -a * r
            l2 = -a * min(max(r, 1 - clip_low), 1 + clip_high)
            loss = max(l1, l2)
            clipped += l2 > l1
            if dual_clip is not None and a < 0:
                if -a * dual_clip < loss:
                    dual += 1
                loss = min(loss, -a * dual_clip)
            row.append(loss)
        per_token.append(row)
    return ref_agg(per_token, mask, mode), clipped / n, dual / n, kl / n


def ref_value(v, old, ret, mask, clip, mode):
    per_token, clipped, n = [], 0, 0
    for vr, orow, rr, mrow in zip(v, old, ret, mask, strict=True):
        row = []
        for vv, o, r, m in zip(vr, orow, rr, mrow, strict=True):
            if not m:
                row.append(0.0)
                continue
            n += 1
            e1 = (vv - r) ** 2
            if clip is None:
                row.append(0.5 * e1)
                continue
            vc = o + min(max(vv - o, -clip), clip)
            e2 = (vc - r) ** 2
            clipped += e2 > e1
            row.append(0.5 * max(e1, e2))
        per_token.append(row)
    return ref_agg(per_token, mask, mode), clipped / n


CASES = [
    (0.2, 0.2, None, "token-mean"),
    (0.2, 0.28, None, "seq-mean-token-mean"),
    (0.1, 0.3, 3.0, "seq-mean-token-sum"),
    (0.2, 0.2, 2.0, "seq-mean-token-sum-norm"),
]


@pytest.mark.parametrize("clip_low,clip_high,dual_clip,agg", CASES)
def test_ppo_policy_loss_matches_reference(clip_low, clip_high, dual_clip, agg):
    old = _rand(0)
    logp = old + _rand(1, 0.5)  # ratios well spread around the clip range
    adv = _rand(2)
    logp[0, 0], adv[0, 0] = old[0, 0] + math.log(4.0), -1.0  # a token the dual clip caps
    want_loss, want_cf, want_dual, want_kl = ref_ppo(
        logp.tolist(), old.tolist(), adv.tolist(), MASK.tolist(), clip_low, clip_high, dual_clip, agg
    )
    assert 0 < want_cf < 1  # the case exercises both branches
    loss, metrics = ppo_policy_loss(logp, old, adv, MASK, clip_low, clip_high, dual_clip, agg)
    assert loss.item() == pytest.approx(want_loss, abs=1e-12)
    assert metrics["clipfrac"] == pytest.approx(want_cf)
    assert metrics["dual_clipfrac"] == pytest.approx(want_dual)
    assert metrics["approx_kl"] == pytest.approx(want_kl, abs=1e-12)
    # Metrics stay on the device as detached 0-dim tensors (no host sync per micro-batch).
    assert all(torch.is_tensor(v) and v.dim() == 0 and not v.requires_grad for v in metrics.values())
    loss32, m32 = ppo_policy_loss(
        logp.float(), old.float(), adv.float(), MASK.bool(), clip_low, clip_high, dual_clip, agg
    )
    assert loss32.dtype == torch.float32
    assert loss32.item() == pytest.approx(want_loss, abs=1e-5)
    assert m32["approx_kl"] == pytest.approx(want_kl, abs=1e-5)
    if dual_clip is not None:
        assert want_dual > 0


def test_ppo_hand_cases():
    one = torch.ones(1, 1)
    lp = torch.full((1, 1), math.log(1.5))
    zero = torch.zeros(1, 1)
    loss, m = ppo_policy_loss(lp, zero, one, one)  # A > 0, ratio above the range: clipped at 1.2
    assert loss.item() == pytest.approx(-1.2) and m["clipfrac"] == 1.0
    loss, m = ppo_policy_loss(lp, zero, -one, one)  # A < 0: pessimistic unclipped 1.5 wins
    assert loss.item() == pytest.approx(1.5) and m["clipfrac"] == 0.0
    lp_low = torch.full((1, 1), math.log(0.7))
    loss, m = ppo_policy_loss(lp_low, zero, -one, one, clip_low=0.2)  # max(0.7, 0.8)
    assert loss.item() == pytest.approx(0.8) and m["clipfrac"] == 1.0
    loss, _ = ppo_policy_loss(lp_low, zero, -one, one, clip_low=0.4)  # inside [0.6, 1.2]
    assert loss.item() == pytest.approx(0.7)
    lp_big = torch.full((1, 1), math.log(5.0))
    loss, m = ppo_policy_loss(lp_big, zero, -one, one, dual_clip=3.0)  # min(5, 3)
    assert loss.item() == pytest.approx(3.0) and m["dual_clipfrac"] == 1.0
    loss, m = ppo_policy_loss(lp_big, zero, one, one, dual_clip=3.0)  # dual clip ignores A > 0
    assert loss.item() == pytest.approx(-1.2) and m["dual_clipfrac"] == 0.0
    assert m["approx_kl"] == pytest.approx(-math.log(5.0))


def test_ppo_gradient_matches_analytic_form():
    old = _rand(0)
    logp = (old + _rand(1, 0.5)).requires_grad_(True)
    adv = _rand(2)
    ppo_policy_loss(logp, old, adv, MASK)[0].backward()
    n = int(MASK.sum())
    for b in range(MASK.shape[0]):
        for t in range(MASK.shape[1]):
            r = math.exp(logp[b, t].item() - old[b, t].item())
            a = adv[b, t].item()
            in_range = 0.8 <= r <= 1.2
            # gradient flows only where the unclipped term is the max
            active = MASK[b, t] and (in_range or (a > 0 and r < 0.8) or (a < 0 and r > 1.2))
            want = -a * r / n if active else 0.0
            assert logp.grad[b, t].item() == pytest.approx(want, abs=1e-12)


def test_ppo_targets_are_detached_and_garbage_under_mask_is_ignored():
    old = _rand(0).requires_grad_(True)
    adv = _rand(2).requires_grad_(True)
    logp = _rand(1).clone()
    logp[MASK == 0] = float("nan")
    logp.requires_grad_(True)
    loss, m = ppo_policy_loss(logp, old, adv, MASK)
    loss.backward()
    assert torch.isfinite(loss) and math.isfinite(m["approx_kl"])
    assert old.grad is None and adv.grad is None
    assert torch.isfinite(logp.grad).all()


def test_ppo_huge_log_ratio_stays_finite():
    loss, _ = ppo_policy_loss(
        torch.full((1, 2), 200.0), torch.zeros(1, 2), -torch.ones(1, 2), torch.ones(1, 2)
    )
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-6)


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_value_loss_matches_reference(clip, agg):
    old = _rand(3)
    values = old + _rand(4, 0.4)
    returns = _rand(5)
    want_loss, want_cf = ref_value(values.tolist(), old.tolist(), returns.tolist(), MASK.tolist(), clip, agg)
    loss, m = value_loss(values, old, returns, MASK, clip_range=clip, agg=agg)
    assert loss.item() == pytest.approx(want_loss, abs=1e-12)
    assert m["clipfrac"] == pytest.approx(want_cf)
    if clip is not None:
        assert 0 < want_cf < 1
    loss32, _ = value_loss(values.float(), old.float(), returns.float(), MASK, clip_range=clip, agg=agg)
    assert loss32.dtype == torch.float32
    assert loss32.item() == pytest.approx(want_loss, abs=1e-5)


def test_value_loss_hand_case_and_gradient():
    values = torch.tensor([[2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[3.0, 1.0]])
    mask = torch.ones(1, 2)
    loss, m = value_loss(values, old, returns, mask)
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.0) / 2)
    loss, m = value_loss(values, old, returns, mask, clip_range=0.5)
    # token 0: v_clip = 0.5, errors 1 and 6.25 -> 0.5 * 6.25; token 1: v_clip = 0, same as v -> 0.5
    assert loss.item() == pytest.approx((3.125 + 0.5) / 2)
    assert m["clipfrac"] == 0.5
    loss.backward()
    # token 0: clipped branch wins and is flat in v -> 0; token 1: d/dv 0.5 (v - R)^2 / 2 = (0 - 1) / 2
    assert values.grad.tolist() == [[0.0, -0.5]]


def test_errors_name_the_argument():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 4\) but logprob has shape \(2, 3\)"):
        ppo_policy_loss(x, x, torch.zeros(2, 4), m)
    with pytest.raises(ValueError, match="mask has shape"):
        ppo_policy_loss(x, x, x, torch.ones(3))
    with pytest.raises(ValueError, match="clip_low=0 must be > 0"):
        ppo_policy_loss(x, x, x, m, clip_low=0)
    with pytest.raises(ValueError, match=r"clip_high=-0\.1 must be > 0"):
        ppo_policy_loss(x, x, x, m, clip_high=-0.1)
    with pytest.raises(ValueError, match=r"dual_clip=1\.0 must be > 1"):
        ppo_policy_loss(x, x, x, m, dual_clip=1.0)
    with pytest.raises(ValueError, match="agg='sum' is not a loss aggregation mode"):
        ppo_policy_loss(x, x, x, m, agg="sum")
    with pytest.raises(ValueError, match=r"returns has shape \(3,\) but values has shape \(2, 3\)"):
        value_loss(x, x, torch.zeros(3), m)
    with pytest.raises(ValueError, match="clip_range=0.0 must be > 0"):
        value_loss(x, x, x, m, clip_range=0.0)
    with pytest.raises(ValueError, match="agg='mean' is not a loss aggregation mode"):
        value_loss(x, x, x, m, agg="mean")


def test_token_weights_scale_each_tokens_loss_before_aggregation():
    """Truncated importance sampling's weights: the weighted per-token loss, aggregated, in float64."""
    g = torch.Generator().manual_seed(3)
    logp = torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    old = logp.detach() + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float64)
    weights = torch.rand(3, 4, generator=g, dtype=torch.float64) * 2
    loss, _ = ppo_policy_loss(logp, old, adv, mask, token_weights=weights)
    ratio = torch.exp(logp - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * weights
    want = (per_token * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(loss, logp)
    (want_grad,) = torch.autograd.grad(want, logp)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-12)
