"""Each registered policy loss against its paper's formula, written out here independently, in float64."""

from __future__ import annotations

import math

import pytest
import torch

from verl.algorithms import AGG_MODES, ppo_policy_loss
from verl.algorithms.policy_losses import POLICY_LOSSES, get_policy_loss

LENGTHS = [7, 3, 5, 1, 6, 4]


def batch(seed=0, spread=0.3, token_adv=False):
    """Log-probs (leaf, float64), old log-probs, per-response (or per-token) advantages and a ragged mask."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(LENGTHS), max(LENGTHS)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * spread).requires_grad_(True)
    if token_adv:
        adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    else:
        adv = torch.tensor([1.5, -0.7, 0.4, -1.2, 0.9, -0.3], dtype=torch.float64)[:, None].expand(B, T).clone()
    return logp, old, adv, mask


def grad_of(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


def tokens(mask):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]


def test_registry_lists_the_losses_with_their_papers():
    assert set(POLICY_LOSSES) >= {"ppo", "gspo", "cispo", "gmpo", "clip_cov", "kl_cov"}
    ids = {"gspo": "2507.18071", "cispo": "2506.13585", "gmpo": "2507.20673", "clip_cov": "2505.22617",
           "kl_cov": "2505.22617", "ppo": "1707.06347"}
    for name, arxiv in ids.items():
        assert arxiv in POLICY_LOSSES[name].paper
        assert f"arXiv:{arxiv}" in POLICY_LOSSES[name].fn.__doc__.splitlines()[0]
    with pytest.raises(ValueError, match="unknown policy loss 'gpso'. Registered: ppo, gspo"):
        get_policy_loss("gpso")


def test_ppo_entry_is_ppo_clip_with_dual_clip():
    logp, old, adv, mask = batch(spread=0.5)
    loss, stats = get_policy_loss("ppo")(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    ref, ref_stats = ppo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    assert stats["clipfrac"] == ref_stats["clipfrac"] > 0
    # PPO-clip written out: the mean over tokens of max(-A r, -A clip(r))
    per = []
    for i, t in tokens(mask):
        r = torch.exp(logp[i, t] - old[i, t])
        a = adv[i, t]
        v = torch.maximum(-a * r, -a * r.clamp(0.8, 1.28))
        per.append(torch.minimum(v, -a * 3.0) if a < 0 else v)
    torch.testing.assert_close(loss, torch.stack(per).mean())


@pytest.mark.parametrize("low, high", [(3e-4, 4e-4), (0.2, 0.2)])
def test_gspo_is_the_papers_sequence_objective(low, high):
    """GSPO eq. (5): J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - low, 1 + high) A_i), s_i = (pi/pi_old)^(1/|y_i|)."""
    logp, old, adv, mask = batch(spread=0.05)
    loss, stats = get_policy_loss("gspo")(logp, old, adv, mask, agg="seq-mean-token-mean", clip_low=low,
                                          clip_high=high)
    terms = []
    for i, n in enumerate(LENGTHS):
        s = torch.exp((logp[i, :n].sum() - old[i, :n].sum()) / n)
        a = adv[i, 0]
        terms.append(torch.minimum(s * a, s.clamp(1 - low, 1 + high) * a))
    ref = -torch.stack(terms).mean()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(ref, logp))
    assert 0 < float(stats["clipfrac"]) < 1 if low < 1e-3 else True


def test_cispo_is_reinforce_weighted_by_the_clipped_detached_ratio():
    """CISPO (MiniMax-M1 eq. 4): J = 1/sum|o_i| sum_i sum_t sg(clip(r_t, 1 - lo, 1 + hi)) A_t log pi_t."""
    logp, old, adv, mask = batch(spread=0.5)
    hi = 0.28
    loss, stats = get_policy_loss("cispo")(logp, old, adv, mask, clip_high=hi)
    objective = []
    weights = []
    for i, t in tokens(mask):
        w = torch.exp(logp[i, t] - old[i, t]).detach().clamp(max=1 + hi)  # no lower bound: the paper's choice
        weights.append(w)
        objective.append(w * adv[i, t] * logp[i, t])
    j = torch.stack(objective).mean()
    torch.testing.assert_close(grad_of(loss, logp), grad_of(-j, logp))
    # the value is -A w (PPO's scale), not one that moves with log pi
    torch.testing.assert_close(loss.detach(), -torch.stack([w * adv[i, t] for w, (i, t) in
                                                            zip(weights, tokens(mask), strict=True)]).mean())
    truncated = (sum(float(torch.exp(logp[i, t].detach() - old[i, t])) > 1 + hi for i, t in tokens(mask))
                 / len(tokens(mask)))
    assert float(stats["clipfrac"]) == pytest.approx(truncated) and truncated > 0
    # a tokens whose ratio left the range keeps a gradient (PPO would zero it)
    assert (grad_of(get_policy_loss("cispo")(logp, old, adv, mask, clip_high=hi)[0], logp)[mask.bool()] != 0).all()


def test_cispo_with_clip_low_clamps_the_weight_on_both_sides_and_counts_both():
    """With clip_low set, w = sg(clip(r, 1 - lo, 1 + hi)): ratios below the floor are raised to it, and the
    clip fraction counts tokens truncated on either side."""
    logp, old, adv, mask = batch(spread=0.5)
    lo, hi = 0.2, 0.28
    loss, stats = get_policy_loss("cispo")(logp, old, adv, mask, clip_low=lo, clip_high=hi)
    ratios = [math.exp(float(logp[i, t].detach() - old[i, t])) for i, t in tokens(mask)]
    weights = [min(max(r, 1 - lo), 1 + hi) for r in ratios]
    below, above = sum(r < 1 - lo for r in ratios), sum(r > 1 + hi for r in ratios)
    assert below > 0 and above > 0  # the batch exercises both sides
    j = torch.stack([w * adv[i, t] * logp[i, t] for w, (i, t) in zip(weights, tokens(mask), strict=True)]).mean()
    torch.testing.assert_close(grad_of(loss, logp), grad_of(-j, logp))
    torch.testing.assert_close(loss.detach(), -torch.stack([w * adv[i, t] for w, (i, t) in
                                                            zip(weights, tokens(mask), strict=True)]).mean())
    assert float(stats["clipfrac"]) == pytest.approx((below + above) / len(ratios))


@pytest.mark.parametrize("token_adv", [False, True])
def test_gmpo_is_the_geometric_mean_of_the_clipped_token_objectives(token_adv):
    """GMPO eq.: J = 1/G sum_i sgn(A_i) prod_t |min(r_t A_i, clip(r_t, e^-eps, e^eps) A_i)|^(1/|o_i|)."""
    logp, old, adv, mask = batch(spread=0.5)
    eps = 0.4
    loss, stats = get_policy_loss("gmpo")(logp, old, adv, mask, agg="seq-mean-token-mean")
    terms = []
    for i, n in enumerate(LENGTHS):
        a = adv[i, 0]
        r = torch.exp(logp[i, :n] - old[i, :n])
        inner = torch.minimum(r * a, r.clamp(math.exp(-eps), math.exp(eps)) * a).abs()
        terms.append(torch.sign(a) * inner.prod() ** (1.0 / n))
    ref = -torch.stack(terms).mean()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(ref, logp))
    assert float(stats["clipfrac"]) > 0


def covariance(logp, adv, mask):
    """Clip-Cov/KL-Cov's per-token Cov(log pi, A) = (log pi - mean log pi)(A - mean A), means over the tokens."""
    pairs = tokens(mask)
    mean_lp = sum(float(logp[i, t].detach()) for i, t in pairs) / len(pairs)
    mean_a = sum(float(adv[i, t]) for i, t in pairs) / len(pairs)
    return {(i, t): (float(logp[i, t].detach()) - mean_lp) * (float(adv[i, t]) - mean_a) for i, t in pairs}


def test_clip_cov_detaches_a_random_fraction_of_the_tokens_in_the_covariance_band():
    logp, old, adv, mask = batch(spread=0.3, token_adv=True)
    cov = covariance(logp, adv, mask)
    low, high, fraction = 0.05, 5.0, 0.2
    band = {k for k, c in cov.items() if low <= c <= high}
    k = min(len(band), math.ceil(fraction * len(cov)))
    assert 0 < k < len(band)  # the draw matters
    fn = get_policy_loss("clip_cov")
    loss, stats = fn(logp, old, adv, mask, fraction=fraction, cov_low=low, cov_high=high,
                     generator=torch.Generator().manual_seed(1))
    g = grad_of(loss, logp)
    removed = {k_ for k_ in cov if g[k_] == 0}
    assert len(removed) == k and removed <= band
    # L = 1/N sum_t (r_t A_t if t not clipped else 0)
    kept = [-(torch.exp(logp[i, t] - old[i, t]) * adv[i, t]) for i, t in cov if (i, t) not in removed]
    ref = torch.stack(kept).sum() / len(cov)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(g, grad_of(ref, logp))
    assert float(stats["clipfrac"]) == pytest.approx(k / len(cov))
    again, _ = fn(logp, old, adv, mask, fraction=fraction, cov_low=low, cov_high=high,
                  generator=torch.Generator().manual_seed(1))
    assert again == loss  # the same draw from the same generator


def test_kl_cov_penalises_the_tokens_of_largest_covariance():
    logp, old, adv, mask = batch(spread=0.3, token_adv=True)
    cov = covariance(logp, adv, mask)
    fraction, beta = 0.15, 0.7
    k = math.ceil(fraction * len(cov))
    top = set(sorted(cov, key=cov.get, reverse=True)[:k])
    loss, stats = get_policy_loss("kl_cov")(logp, old, adv, mask, fraction=fraction, kl_coef=beta)
    # L = 1/N sum_t (-r_t A_t + beta |log pi_t - log pi_old,t| for t in the top-k covariance tokens)
    per = [-(torch.exp(logp[i, t] - old[i, t]) * adv[i, t])
           + (beta * (logp[i, t] - old[i, t]).abs() if (i, t) in top else 0.0) for i, t in cov]
    ref = torch.stack(per).mean()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grad_of(loss, logp), grad_of(ref, logp))
    assert float(stats["clipfrac"]) == pytest.approx(k / len(cov))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("agg", AGG_MODES)
def test_every_loss_honours_every_aggregation_weights_and_padding(name, agg):
    """The aggregation modes apply to every loss: seq-mean-token-sum is the mean over responses of each
    response's token sum of the same per-token losses that token-mean averages; token weights of 2 double the
    loss; NaN under the mask leaks into nothing; metrics are 0-dim tensors."""
    logp, old, adv, mask = batch(spread=0.2, token_adv=name not in ("gspo", "gmpo"))
    opts = {"fraction": 0.2, "cov_low": -10.0, "cov_high": 10.0} if name == "clip_cov" else (
        {"fraction": 0.2} if name == "kl_cov" else {})
    fn = get_policy_loss(name)

    def run(agg_mode, lp=logp, o=old, weights=None):
        return fn(lp, o, adv, mask, agg=agg_mode, norm_len=7, token_weights=weights,
                  generator=torch.Generator().manual_seed(0), **opts)

    loss, stats = run(agg)
    assert all(v.dim() == 0 for v in stats.values())
    doubled, _ = run(agg, weights=torch.full_like(mask, 2.0))
    torch.testing.assert_close(doubled, 2 * loss)
    poisoned = torch.where(mask.bool(), logp, torch.nan)
    bad_old = torch.where(mask.bool(), old, torch.inf)
    same, _ = run(agg, poisoned, bad_old)
    torch.testing.assert_close(same, loss)
    assert torch.isfinite(grad_of(same, logp)).all()
    # per-token losses recovered from token-sum: token-mean and seq-mean-token-sum must agree with them
    token_sum = run("seq-mean-token-sum")[0] * len(LENGTHS)
    n_tokens = mask.sum()
    if agg == "token-mean" and name not in ("gspo", "gmpo"):
        torch.testing.assert_close(loss * n_tokens, token_sum)
    if agg == "seq-mean-token-sum-norm":
        torch.testing.assert_close(loss * 7, run("seq-mean-token-sum")[0])


def test_a_loss_refuses_options_it_does_not_have():
    with pytest.raises(ValueError, match=r"'dual_clip' is not an option of policy_loss gspo.*Its options: "
                                         r"clip_low, clip_high"):
        get_policy_loss("gspo")(*batch()[:4], dual_clip=3.0)
    with pytest.raises(ValueError, match="'fracton' is not an option of policy_loss kl_cov. Its options: fraction"):
        get_policy_loss("kl_cov")(*batch()[:4], fracton=0.1)
