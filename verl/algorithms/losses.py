"""PPO policy and value losses, per token, aggregated by `aggregate_loss`.

Old log-probabilities, advantages, old values and returns are targets computed before the update, so
they are detached here: a gradient leaking into them would silently train on a moving target.
"""

from __future__ import annotations

import torch

from .core import _bool_mask, _check_agg, _check_positive, _check_same_shape, aggregate_loss, masked_mean

# exp(20) ~ 5e8: far beyond any clip range, and it keeps exp() finite in float16 and float32.
_MAX_LOG_RATIO = 20.0


def ppo_policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_len: int | float | None = None,
    sequence_ratio: bool = False,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), r = exp(logp - old).

    `sequence_ratio=True` is GSPO's sequence-level importance ratio: every token of a response takes the
    value s = exp(mean over its tokens of (logp - old)), the length-normalised ratio of the whole response,
    so a response is clipped as one, while each token's gradient stays its own log-prob's times s (GSPO's
    token form, `logp - sg(logp) + sg(log s)`); with `seq-mean-token-mean` this is GSPO's objective.

    `token_weights` (detached, same shape) multiply each token's loss before aggregation: truncated importance
    sampling's `min(pi_old / pi_rollout, cap)` when the sampler's distribution differs from the trainer's.

    Separate `clip_low`/`clip_high` allow asymmetric ("clip-higher", DAPO) ranges. `dual_clip=c` caps
    the loss of negative-advantage tokens at -A c, so one token whose probability already collapsed
    cannot dominate the batch. The log-ratio is clamped to +-20 before exp() so that a stale or corrupt
    old log-probability gives a large finite loss instead of inf or NaN.

    Returns (loss, metrics) with 0-dim tensor metrics (no host sync; callers convert once) `clipfrac` (share of unmasked
    tokens where the clipped term won), `dual_clipfrac` (share where the dual clip won) and `approx_kl`
    (mean of old - logp).
    """
    _check_same_shape("logprob", logprob, old_logprob=old_logprob, advantages=advantages, mask=mask)
    _check_positive("clip_low", clip_low)
    _check_positive("clip_high", clip_high)
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip={dual_clip!r} must be > 1 (or None to disable)")
    _check_agg(agg, "agg")
    m = _bool_mask(mask, logprob)
    old = torch.where(m, old_logprob.detach(), 0)
    adv = torch.where(m, advantages.detach(), 0)
    logp = torch.where(m, logprob, 0)
    log_ratio = logp - old
    if sequence_ratio:
        if logp.dim() != 2:
            raise ValueError(f"sequence_ratio needs [batch, tokens] log-probs, got shape {tuple(logp.shape)}")
        per_sequence = log_ratio.detach().sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)
        log_ratio = logp - logp.detach() + per_sequence
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_hit = (clipped > unclipped) & m
    if dual_clip is not None:
        cap = -adv * dual_clip
        negative = adv < 0
        dual_hit = negative & (cap < per_token) & m
        per_token = torch.where(negative, torch.minimum(per_token, cap), per_token)
    else:
        dual_hit = torch.zeros_like(m)
    if token_weights is not None:
        _check_same_shape("logprob", logprob, token_weights=token_weights)
        per_token = per_token * torch.where(m, token_weights.detach(), 0)
    loss = aggregate_loss(per_token, m, agg, norm_len)
    with torch.no_grad():
        n = m.sum().clamp(min=1)
        metrics = {
            "clipfrac": clip_hit.sum() / n,
            "dual_clipfrac": dual_hit.sum() / n,
            "approx_kl": masked_mean(old - logp.detach(), m),
        }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = None,
    agg: str = "token-mean",
    norm_len: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip = old + clip(v - old, -c, c).

    The clip keeps the critic close to the values the advantages were computed with; `clip_range=None`
    gives the plain squared error. Returns (loss, metrics) with the 0-dim tensor metric `clipfrac` (share of unmasked
    tokens where the clipped error won).
    """
    _check_same_shape("values", values, old_values=old_values, returns=returns, mask=mask)
    if clip_range is not None:
        _check_positive("clip_range", clip_range)
    _check_agg(agg, "agg")
    m = _bool_mask(mask, values)
    v = torch.where(m, values, 0)
    ret = torch.where(m, returns.detach(), 0)
    err = (v - ret) ** 2
    if clip_range is None:
        per_token = 0.5 * err
        clip_hit = torch.zeros_like(m)
    else:
        old = torch.where(m, old_values.detach(), 0)
        v_clip = old + (v - old).clamp(-clip_range, clip_range)
        err_clip = (v_clip - ret) ** 2
        per_token = 0.5 * torch.maximum(err, err_clip)
        clip_hit = (err_clip > err) & m
    loss = aggregate_loss(per_token, m, agg, norm_len)
    with torch.no_grad():
        metrics = {"clipfrac": clip_hit.sum() / m.sum().clamp(min=1)}
    return loss, metrics
