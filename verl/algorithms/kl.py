"""KL estimators between the policy and the reference model, and the controllers of the KL coefficient.

The estimators are Schulman's per-token estimators of KL(policy || ref) from samples of the policy:
k1 is unbiased but noisy and can be negative, k3 is unbiased and always >= 0 (the usual choice for a
KL loss), k2 is a biased low-variance estimator, abs is |k1|.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .core import _check_same_shape

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
K3_CLAMP = 10.0


def sequence_kl_sums(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum over sequences of each one's mean per-token KL, number of sequences], in float64.

    The adaptive controller's input is the per-token KL averaged within each response, then over the
    batch (the unit of `algorithm.kl_target`). As sums, shards add up to the global batch's value:
    divide the first entry by the second after summing over data-parallel ranks. Empty responses
    (no unmasked token) have no per-token KL and are not counted.
    """
    _check_same_shape("kl", kl, mask=mask)
    m = mask != 0
    tokens = m.sum(-1)
    per_seq = torch.where(m, kl, 0).double().sum(-1) / tokens.clamp(min=1)
    has = tokens > 0
    return torch.stack([per_seq[has].sum(), has.sum().double()])


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate: k1 = logp - ref, k2 = 0.5 (logp - ref)^2, k3 = exp(ref - logp) - (ref - logp) - 1
    (clamped to [-10, 10]), abs = |logp - ref|."""
    _check_same_shape("logprob", logprob, ref_logprob=ref_logprob)
    diff = logprob - ref_logprob
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff * diff
    if kind == "k3":
        # expm1(x) - x is exp(x) - x - 1 without the cancellation that loses small KLs in float32. The
        # log-ratio is bounded first (exp(89) overflows float32, and inf would give NaN gradients), the
        # estimate then clamped to [-10, 10] so one extreme token cannot dominate a batch.
        x = (-diff).clamp(-20.0, 20.0)
        return (torch.expm1(x) - x).clamp(-K3_CLAMP, K3_CLAMP)
    if kind == "abs":
        return diff.abs()
    raise ValueError(f"kind={kind!r} is not a KL estimator; use one of {', '.join(KL_KINDS)}")


def _check_state(state: dict[str, Any], cls: str) -> float:
    if not isinstance(state, dict) or "value" not in state:
        raise ValueError(
            f"state for {cls}.load_state_dict has no 'value' key; pass the dict from state_dict()"
        )
    value = float(state["value"])
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"state['value']={value!r} for {cls} must be a finite number >= 0")
    return value


def _check_update(current_kl: float | torch.Tensor, n_steps: int) -> float:
    kl = float(current_kl)
    if not math.isfinite(kl):
        raise ValueError(f"current_kl={kl!r} is not finite; check the KL of this batch before updating")
    if n_steps < 0:
        raise ValueError(f"n_steps={n_steps!r} must be >= 0")
    return kl


class FixedKLController:
    """A KL coefficient that never changes; `update` only validates, so both controllers are interchangeable."""

    def __init__(self, coef: float) -> None:
        if not (math.isfinite(coef) and coef >= 0):
            raise ValueError(f"coef={coef!r} must be a finite number >= 0")
        self.value = float(coef)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        _check_update(current_kl, n_steps)

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = _check_state(state, "FixedKLController")


class AdaptiveKLController:
    """Proportional controller (Ziegler et al. 2019) steering the observed KL towards `target`.

    error = clip(current_kl / target - 1, -0.2, 0.2); value *= 1 + error * n_steps / horizon. The clip
    bounds how fast the coefficient can move on one noisy batch.
    """

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        if not (math.isfinite(init_coef) and init_coef >= 0):
            raise ValueError(f"init_coef={init_coef!r} must be a finite number >= 0")
        if not target > 0:
            raise ValueError(f"target={target!r} must be > 0")
        if not horizon > 0:
            raise ValueError(f"horizon={horizon!r} must be > 0")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> None:
        kl = _check_update(current_kl, n_steps)
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """The coefficient, plus target and horizon for inspection."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient only: target and horizon come from the (possibly edited) config."""
        self.value = _check_state(state, "AdaptiveKLController")
