"""The policy losses as one registry: name -> pure function, its options with their defaults, its paper.

The config (`actor.policy_loss`, `actor.loss_options`), its checks ("did you mean", options that do not
apply), the trainer and the docs table all read `POLICY_LOSSES`, so a loss is added in one place:
`@register_policy_loss(name, paper=..., options=...)` on a function

    fn(logprob, old_logprob, advantages, mask, *, agg, norm_len, token_weights, generator, **options)
        -> (loss, {"clipfrac": 0-dim tensor, "approx_kl": 0-dim tensor})

whose per-token losses go through `aggregate_loss` (every `actor.loss_agg` mode applies to every loss).
`clipfrac` is the share of unmasked tokens whose gradient the loss cut or changed (each loss's docstring
says which); metrics stay on the device (no host sync).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .core import _bool_mask, _check_agg, _check_same_shape, aggregate_loss, masked_mean
from .losses import _MAX_LOG_RATIO, ppo_policy_loss

Tensor = torch.Tensor


@dataclass(frozen=True)
class LossOption:
    """One option of a loss: its default, what it means, and the values it accepts (`check` returns the
    problem as a phrase, or None)."""

    default: Any
    help: str
    check: Callable[[Any], str | None] = field(default=lambda v: None)


def _positive(v: Any) -> str | None:
    return None if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else "must be a number > 0"


def _positive_or_none(v: Any) -> str | None:
    return None if v is None else _positive(v)


def _above_one_or_none(v: Any) -> str | None:
    ok = v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 1)
    return None if ok else "must be a number > 1, or null (off)"


def _fraction(v: Any) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1
    return None if ok else "must be a number in [0, 1]"


def _number(v: Any) -> str | None:
    return None if isinstance(v, (int, float)) and not isinstance(v, bool) else "must be a number"


@dataclass(frozen=True)
class PolicyLoss:
    """A registered loss: `fn`, its `options` (name -> LossOption), its paper's arXiv id and a summary."""

    name: str
    fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    options: Mapping[str, LossOption]
    paper: str
    summary: str
    clipfrac: str  # what the loss's clipfrac counts
    # a row's loss reads only its own tokens and is exactly 0 (value and gradient) when its advantages are
    # all 0, so the update may skip such rows; the covariance losses select tokens across the micro-batch
    row_local: bool = True

    def defaults(self) -> dict[str, Any]:
        return {k: o.default for k, o in self.options.items()}

    def problems(self, options: Mapping[str, Any], hint: Callable[[str, Any], str] = lambda word, choices: "",
                 ) -> list[str]:
        """What is wrong with `options` for this loss: unknown names (with `hint(name, this loss's options)`,
        the config layer's "did you mean", and the options listed) and values out of range. Empty when fine."""
        out = []
        own = ", ".join(self.options) or "none"
        for key, value in options.items():
            if key not in self.options:
                out.append(f"'{key}' is not an option of policy_loss {self.name}.{hint(key, self.options)} "
                           f"Its options: {own}")
                continue
            problem = self.options[key].check(value)
            if problem is not None:
                out.append(f"{self.name} option {key}={value!r} {problem}")
        return out

    def __call__(self, logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, *,
                 agg: str = "token-mean", norm_len: int | float | None = None,
                 token_weights: Tensor | None = None, generator: torch.Generator | None = None,
                 **options: Any) -> tuple[Tensor, dict[str, Tensor]]:
        problems = self.problems(options)
        if problems:
            raise ValueError("; ".join(problems))
        return self.fn(logprob, old_logprob, advantages, mask, agg=agg, norm_len=norm_len,
                       token_weights=token_weights, generator=generator, **{**self.defaults(), **options})


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, paper: str, summary: str, clipfrac: str,
                         options: Mapping[str, LossOption] | None = None, row_local: bool = True) -> Callable:
    """Decorator: register `fn` as policy loss `name` (see the module docstring for its signature)."""

    def wrap(fn: Callable) -> Callable:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice")
        POLICY_LOSSES[name] = PolicyLoss(name, fn, dict(options or {}), paper, summary, clipfrac, row_local)
        return fn

    return wrap


def get_policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}. "
                         f"Registered: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


# ---------------------------------------------------------------------- shared pieces
def _prepare(logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, agg: str,
             token_weights: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Checked inputs with the padding zeroed: (bool mask, logp, detached old, detached advantages)."""
    _check_same_shape("logprob", logprob, old_logprob=old_logprob, advantages=advantages, mask=mask)
    if token_weights is not None:
        _check_same_shape("logprob", logprob, token_weights=token_weights)
    _check_agg(agg, "agg")
    m = _bool_mask(mask, logprob)
    return (m, torch.where(m, logprob, 0), torch.where(m, old_logprob.detach(), 0),
            torch.where(m, advantages.detach(), 0))


def _finish(per_token: Tensor, m: Tensor, logp: Tensor, old: Tensor, hit: Tensor, agg: str,
            norm_len: int | float | None, token_weights: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    if token_weights is not None:
        per_token = per_token * torch.where(m, token_weights.detach(), 0)
    loss = aggregate_loss(per_token, m, agg, norm_len)
    with torch.no_grad():
        metrics = {"clipfrac": (hit & m).sum() / m.sum().clamp(min=1), "approx_kl": masked_mean(old - logp.detach(), m)}
    return loss, metrics


def _ratio(logp: Tensor, old: Tensor) -> Tensor:
    return torch.exp((logp - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def _need_2d(name: str, logp: Tensor) -> None:
    if logp.dim() != 2:
        raise ValueError(f"policy_loss {name} needs [batch, tokens] log-probs, got shape {tuple(logp.shape)}")


def _token_covariance(logp: Tensor, adv: Tensor, m: Tensor) -> Tensor:
    """Each token's centred product (log pi - mean log pi)(A - mean A) over the unmasked tokens (detached)."""
    n = m.sum().clamp(min=1)
    lp = logp.detach()
    mean_lp = torch.where(m, lp, 0).sum() / n
    mean_a = torch.where(m, adv, 0).sum() / n
    return torch.where(m, (lp - mean_lp) * (adv - mean_a), 0)


def _top_k(score: Tensor, eligible: Tensor, k: Tensor) -> Tensor:
    """Bool mask of the `k` (a tensor: no host sync) eligible entries with the highest score."""
    flat = torch.where(eligible, score, -math.inf).flatten()
    order = torch.argsort(flat, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return (rank.view_as(score) < k) & eligible


def _count(fraction: float, m: Tensor) -> Tensor:
    """ceil(fraction x unmasked tokens): at least one token of any micro-batch with fraction > 0."""
    return torch.ceil(fraction * m.sum().to(torch.float64))


# ---------------------------------------------------------------------- the losses
_CLIP = {
    "clip_low": LossOption(0.2, "ratio floor 1 - clip_low", _positive),
    "clip_high": LossOption(0.2, "ratio ceiling 1 + clip_high (0.28: DAPO's clip-higher)", _positive),
}


@register_policy_loss(
    "ppo", paper="arXiv:1707.06347 (PPO); clip-higher arXiv:2503.14476 (DAPO); dual clip arXiv:1912.09729",
    summary="PPO-clip per token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), optional dual clip",
    clipfrac="tokens where the clipped term won",
    options={**_CLIP, "dual_clip": LossOption(None, "cap -A c on negative-advantage tokens (c > 1); null = off",
                                              _above_one_or_none)})
def ppo_loss(logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, *, agg: str,
             norm_len: int | float | None, token_weights: Tensor | None, generator: torch.Generator | None,
             clip_low: float, clip_high: float, dual_clip: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO (arXiv:1707.06347): `ppo_policy_loss`, per token."""
    loss, stats = ppo_policy_loss(logprob, old_logprob, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                  dual_clip=dual_clip, agg=agg, norm_len=norm_len, token_weights=token_weights)
    return loss, {"clipfrac": stats["clipfrac"], "approx_kl": stats["approx_kl"]}


@register_policy_loss(
    "gspo", paper="arXiv:2507.18071 (GSPO)",
    summary="PPO-clip on each response's length-normalised ratio exp(mean(log r)); the paper pairs it with "
            "loss_agg seq-mean-token-mean",
    clipfrac="tokens of responses whose sequence ratio was clipped",
    options={"clip_low": LossOption(3e-4, "sequence-ratio floor 1 - clip_low (the paper: 3e-4)", _positive),
             "clip_high": LossOption(4e-4, "sequence-ratio ceiling 1 + clip_high (the paper: 4e-4)", _positive)})
def gspo_loss(logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, *, agg: str,
              norm_len: int | float | None, token_weights: Tensor | None, generator: torch.Generator | None,
              clip_low: float, clip_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (arXiv:2507.18071), its token form: the sequence ratio's value, each token's own gradient."""
    loss, stats = ppo_policy_loss(logprob, old_logprob, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                                  agg=agg, norm_len=norm_len, sequence_ratio=True, token_weights=token_weights)
    return loss, {"clipfrac": stats["clipfrac"], "approx_kl": stats["approx_kl"]}


@register_policy_loss(
    "cispo", paper="arXiv:2506.13585 (MiniMax-M1, CISPO)",
    summary="REINFORCE weighted by the clipped, detached ratio sg(clip(r, 1 - clip_low, 1 + clip_high)): "
            "no token loses its gradient",
    clipfrac="tokens whose weight was truncated",
    options={"clip_low": LossOption(None, "weight floor 1 - clip_low; null = no floor (the paper's choice)",
                                    _positive_or_none),
             "clip_high": LossOption(0.28, "weight ceiling 1 + clip_high", _positive)})
def cispo_loss(logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, *, agg: str,
               norm_len: int | float | None, token_weights: Tensor | None, generator: torch.Generator | None,
               clip_low: float | None, clip_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (arXiv:2506.13585): loss -sg(w) A log pi, w = clip(r, 1 - clip_low, 1 + clip_high).

    Written as -A w (1 + log pi - sg(log pi)): the paper's gradient, and a value (-A w) on PPO's scale
    rather than one that moves with log pi."""
    m, logp, old, adv = _prepare(logprob, old_logprob, advantages, mask, agg, token_weights)
    ratio = _ratio(logp, old).detach()
    low = 0.0 if clip_low is None else 1.0 - clip_low
    weight = ratio.clamp(low, 1.0 + clip_high)
    per_token = -adv * weight * (1.0 + logp - logp.detach())
    return _finish(per_token, m, logp, old, weight != ratio, agg, norm_len, token_weights)


@register_policy_loss(
    "gmpo", paper="arXiv:2507.20673 (GMPO)",
    summary="geometric mean of the token ratios of a response, each clipped in log space to "
            "[-clip_low, clip_high] (pessimistically, as PPO), times A",
    clipfrac="tokens whose log-ratio was clipped",
    options={"clip_low": LossOption(0.4, "log-ratio floor -clip_low (the paper: 0.4, ratio e^-0.4)", _positive),
             "clip_high": LossOption(0.4, "log-ratio ceiling clip_high (the paper: 0.4)", _positive)})
def gmpo_loss(logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, *, agg: str,
              norm_len: int | float | None, token_weights: Tensor | None, generator: torch.Generator | None,
              clip_low: float, clip_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (arXiv:2507.20673): -sgn(A) (prod_t |min(r_t A, clip(r_t, e^-lo, e^hi) A)|)^(1/|o|).

    For a positive advantage that is -A exp(mean_t min(log r_t, clip(log r_t))), for a negative one
    max instead of min. Every token of a response carries its response's value, so `seq-mean-token-mean`
    is the paper's objective and the other aggregations weigh responses as they say."""
    m, logp, old, adv = _prepare(logprob, old_logprob, advantages, mask, agg, token_weights)
    _need_2d("gmpo", logp)
    log_ratio = logp - old
    clipped = log_ratio.clamp(-clip_low, clip_high)
    chosen = torch.where(adv >= 0, torch.minimum(log_ratio, clipped), torch.maximum(log_ratio, clipped))
    chosen = torch.where(m, chosen, 0)
    length = m.sum(dim=1, keepdim=True).clamp(min=1)
    mean_log = (chosen.sum(dim=1, keepdim=True) / length).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    per_token = -adv * torch.exp(mean_log)
    return _finish(per_token, m, logp, old, chosen.detach() != log_ratio.detach(), agg, norm_len, token_weights)


_COV_CITE = "arXiv:2505.22617 (The Entropy Mechanism of RL for Reasoning LMs)"


@register_policy_loss(
    "clip_cov", paper=_COV_CITE + ", Clip-Cov",
    summary="policy gradient -A r, with the gradient of a random `fraction` of the tokens whose centred "
            "covariance (log pi - mean)(A - mean) lies in [cov_low, cov_high] removed",
    clipfrac="tokens whose gradient was removed", row_local=False,
    options={"fraction": LossOption(2e-4, "share of the micro-batch's tokens to detach (at least one)", _fraction),
             "cov_low": LossOption(1.0, "lower bound of the covariance band", _number),
             "cov_high": LossOption(5.0, "upper bound of the covariance band", _number)})
def clip_cov_loss(logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, *, agg: str,
                  norm_len: int | float | None, token_weights: Tensor | None, generator: torch.Generator | None,
                  fraction: float, cov_low: float, cov_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (arXiv:2505.22617): -A r per token, 0 for ceil(fraction N) tokens drawn at random (with
    `generator`) among those whose covariance lies in [cov_low, cov_high]; N and the means are the
    micro-batch's unmasked tokens."""
    m, logp, old, adv = _prepare(logprob, old_logprob, advantages, mask, agg, token_weights)
    cov = _token_covariance(logp, adv, m)
    band = m & (cov >= cov_low) & (cov <= cov_high)
    draw = torch.rand(cov.shape, generator=generator, device=cov.device, dtype=torch.float32)
    chosen = _top_k(draw, band, _count(fraction, m))
    per_token = torch.where(chosen, 0, -adv * _ratio(logp, old))
    return _finish(per_token, m, logp, old, chosen, agg, norm_len, token_weights)


@register_policy_loss(
    "kl_cov", paper=_COV_CITE + ", KL-Cov",
    summary="policy gradient -A r, plus kl_coef |log pi - log pi_old| on the `fraction` of tokens with the "
            "largest centred covariance",
    clipfrac="tokens that got the KL penalty", row_local=False,
    options={"fraction": LossOption(2e-3, "share of the micro-batch's tokens penalised (at least one)", _fraction),
             "kl_coef": LossOption(1.0, "weight of the penalty", _number)})
def kl_cov_loss(logprob: Tensor, old_logprob: Tensor, advantages: Tensor, mask: Tensor, *, agg: str,
                norm_len: int | float | None, token_weights: Tensor | None, generator: torch.Generator | None,
                fraction: float, kl_coef: float) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (arXiv:2505.22617): -A r per token, plus kl_coef |log pi - log pi_old| on the ceil(fraction N)
    tokens of the micro-batch with the largest covariance (log pi - mean)(A - mean)."""
    m, logp, old, adv = _prepare(logprob, old_logprob, advantages, mask, agg, token_weights)
    cov = _token_covariance(logp, adv, m)
    chosen = _top_k(cov, m, _count(fraction, m))
    per_token = -adv * _ratio(logp, old) + torch.where(chosen, kl_coef * (logp - old).abs(), 0)
    return _finish(per_token, m, logp, old, chosen, agg, norm_len, token_weights)


POLICY_LOSS_NAMES: tuple[str, ...] = tuple(POLICY_LOSSES)

__all__ = ["POLICY_LOSSES", "POLICY_LOSS_NAMES", "LossOption", "PolicyLoss", "get_policy_loss",
           "register_policy_loss"]
