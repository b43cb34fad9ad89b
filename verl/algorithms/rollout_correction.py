"""Rollout correction: weigh or reject tokens sampled by a behaviour policy that is not the trained one.

The sampler (vLLM, bf16 kernels, a stale engine) draws tokens from pi_b; PPO's ratio is taken against the
proximal policy pi_p (the trainer's recomputed old log-probs). Their per-token ratio r = pi_p / pi_b corrects
the expectation (importance sampling) or flags tokens the sampler got badly wrong (rejection, "MIS").
Everything happens in log space, so a product over a long response cannot overflow.

Modes: token_tis   w = min(r_t, cap)                        (truncated IS per token)
       seq_tis     w = min(prod_t r_t, cap) for every token    (sequence-level truncated IS)
       seq_tis_geo w = min(exp(mean_t log r_t), cap)          (geometric mean: length-independent scale)
       token_mask  keep tokens with lo <= r_t <= hi
       seq_mask    keep responses whose geometric-mean ratio is in [lo, hi] (a product of hundreds of
                   ratios leaves any fixed band, so the mask uses the geometric mean)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CORRECTION_MODES = ("off", "token_tis", "seq_tis", "seq_tis_geo", "token_mask", "seq_mask")


@dataclass(frozen=True)
class Correction:
    """weights: [B, T] per-token loss weights (0 on rejected and padded tokens), detached; keep: [B, T] bool,
    the response tokens not rejected; metrics: 0-dim tensors (no host sync)."""

    weights: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, torch.Tensor]


def log_ratio(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi_p - log pi_b per token, 0 off the mask (padding may hold -inf or garbage)."""
    m = mask.bool()
    return torch.where(m, proximal.detach() - behaviour.to(proximal), 0.0)


def sequence_log_ratio(log_r: torch.Tensor, mask: torch.Tensor, *, geometric: bool) -> torch.Tensor:
    """[B]: log of the product of a response's ratios, or of their geometric mean (`geometric`)."""
    m = mask.to(log_r.dtype)
    total = (log_r * m).sum(-1)
    return total / m.sum(-1).clamp(min=1) if geometric else total


def truncated_weights(log_w: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(log_w), cap), clamped before exp so that no product overflows to inf."""
    return torch.exp(log_w.clamp(max=math.log(cap)))


def in_band(log_w: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """lo <= exp(log_w) <= hi, decided in log space."""
    return (log_w >= math.log(lo)) & (log_w <= math.log(hi))


def behaviour_kl(log_r: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(pi_b || pi_p) per token from tokens drawn by pi_b: k1 = -log r and k3 = r - 1 - log r (unbiased,
    never negative); their means over the masked tokens."""
    m = mask.bool()
    n = m.sum().clamp(min=1)
    k1 = torch.where(m, -log_r, 0.0).sum() / n
    k3 = torch.where(m, torch.expm1(log_r) - log_r, 0.0).sum() / n
    return k1, k3


def rollout_correction(proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, mode: str, *,
                       cap: float = 2.0, lo: float = 0.5, hi: float = 2.0) -> Correction:
    """Weights and rejection mask of `mode` (see the module docstring) for [B, T] log-probs of the proximal
    (trainer, old) and behaviour (sampler) policies on the same sampled tokens; `mask` marks response tokens.

    Metrics (means over the mask): ratio_mean/max/min of the per-token ratio, weight_mean, truncated_frac
    (tokens whose weight hit `cap`), masked_frac (tokens rejected), kl_k1 / kl_k3 (behaviour vs proximal)."""
    if mode not in CORRECTION_MODES or mode == "off":
        raise ValueError(f"rollout correction mode {mode!r}: use one of {', '.join(CORRECTION_MODES[1:])}")
    m = mask.bool()
    log_r = log_ratio(proximal, behaviour, m)
    keep = m
    truncated = torch.zeros_like(m)
    if mode == "token_tis":
        log_w = log_r
    elif mode in ("seq_tis", "seq_tis_geo"):
        log_w = sequence_log_ratio(log_r, m, geometric=mode == "seq_tis_geo")[:, None].expand_as(log_r)
    elif mode == "token_mask":
        log_w = torch.zeros_like(log_r)
        keep = m & in_band(log_r, lo, hi)
    else:  # seq_mask
        log_w = torch.zeros_like(log_r)
        keep = m & in_band(sequence_log_ratio(log_r, m, geometric=True), lo, hi)[:, None]
    if mode.endswith(("tis", "tis_geo")):
        weights = truncated_weights(log_w, cap)
        truncated = m & (log_w >= math.log(cap))
    else:
        weights = torch.ones_like(log_r)
    weights = torch.where(keep, weights, 0.0).detach()

    n = m.sum().clamp(min=1)
    ratio = torch.exp(log_r)
    k1, k3 = behaviour_kl(log_r, m)
    big, any_token = torch.finfo(log_r.dtype).max, m.any()
    metrics = {
        "ratio_mean": torch.where(m, ratio, 0.0).sum() / n,
        "ratio_max": torch.where(any_token, torch.where(m, ratio, -big).max(), 0.0),  # no host sync
        "ratio_min": torch.where(any_token, torch.where(m, ratio, big).min(), 0.0),
        "weight_mean": torch.where(m, weights, 0.0).sum() / n,
        "truncated_frac": truncated.sum() / n,
        "masked_frac": (m & ~keep).sum() / n,
        "kl_k1": k1,
        "kl_k3": k3,
    }
    return Correction(weights=weights, keep=keep, metrics={k: v.detach() for k, v in metrics.items()})


__all__ = ["CORRECTION_MODES", "Correction", "behaviour_kl", "in_band", "log_ratio", "rollout_correction",
           "sequence_log_ratio", "truncated_weights"]
