"""Entropy control: an adaptive entropy-bonus coefficient, the high-entropy token mask, entropy quantiles.

Every function here works on [..., T] tensors with a 0/1 mask and without a host sync (no boolean
indexing, no `.item()`), so the trainer can call them between a micro-batch's forward and backward.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .core import _check_same_shape


def _sorted_valid(values: torch.Tensor, mask: torch.Tensor, descending: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The unmasked values flattened and sorted (masked ones pushed to the end), and their count (0-dim)."""
    m = mask.reshape(-1) != 0
    fill = -math.inf if descending else math.inf
    flat = torch.where(m, values.reshape(-1), torch.full_like(values.reshape(-1), fill))
    return torch.sort(flat, descending=descending).values, m.sum()


def masked_quantiles(values: torch.Tensor, mask: torch.Tensor, qs: tuple[float, ...]) -> torch.Tensor:
    """[len(qs)] quantiles of the unmasked elements, linearly interpolated as `torch.quantile` does; 0 where
    no element is unmasked. Sync-free: the count stays a tensor and indexes the sorted values."""
    _check_same_shape("values", values, mask=mask)
    if not all(0.0 <= q <= 1.0 for q in qs):
        raise ValueError(f"qs={qs!r}: every quantile must lie in [0, 1]")
    ordered, n = _sorted_valid(values, mask, descending=False)
    if ordered.numel() == 0:
        return values.new_zeros(len(qs))
    pos = torch.tensor(qs, dtype=torch.float64, device=values.device) * (n - 1).clamp(min=0).double()
    lo = pos.floor().long()
    hi = (lo + 1).clamp(max=(n - 1).clamp(min=0))
    frac = (pos - lo.double()).to(values.dtype)
    a, b = ordered.gather(0, lo), ordered.gather(0, hi)
    out = a + (b - a) * frac
    return torch.where(n > 0, out, torch.zeros_like(out))


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """0/1 mask (entropy's dtype) of the highest-entropy `fraction` of the unmasked tokens: those at or
    above the ceil(fraction x count)-th largest entropy (ties at the threshold all kept).

    Wang et al. 2025, "Beyond the 80/20 Rule" (arXiv 2506.01939): training only on the ~20% forking tokens
    of highest entropy matches or beats training on all. The threshold is over every unmasked token of the
    tensors given (the caller decides the scope: the trainer passes one micro-batch).
    """
    _check_same_shape("entropy", entropy, mask=mask)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction={fraction!r} must lie in (0, 1]")
    valid = mask != 0
    if fraction == 1.0 or entropy.numel() == 0:
        return valid.to(entropy.dtype)
    ordered, n = _sorted_valid(entropy.detach(), mask, descending=True)
    k = torch.ceil(n.double() * fraction).long().clamp(min=1)
    threshold = ordered.gather(0, (k - 1).reshape(1)).reshape(())
    return (valid & (entropy.detach() >= threshold)).to(entropy.dtype)


def _finite(name: str, value: float, low: float = 0.0, *, strict: bool = False) -> float:
    value = float(value)
    if not math.isfinite(value) or value < low or (strict and value == low):
        raise ValueError(f"{name}={value!r} must be a finite number {'>' if strict else '>='} {low}")
    return value


class AdaptiveEntropyController:
    """The entropy-bonus coefficient steered towards `target` entropy (nats per token).

    value <- clip(value + step_size x (target - entropy), 0, max_coef) after each update: the bonus grows
    while the policy's entropy is below the target (collapse) and shrinks back to 0 above it. The clip
    bounds the bonus, so one low-entropy batch cannot make it dominate the policy-gradient loss.
    """

    def __init__(self, init_coef: float, target: float, step_size: float, max_coef: float) -> None:
        self.target = _finite("target", target, strict=True)
        self.step_size = _finite("step_size", step_size, strict=True)
        self.max_coef = _finite("max_coef", max_coef)
        self.value = min(_finite("init_coef", init_coef), self.max_coef)

    def update(self, entropy: float | torch.Tensor) -> float:
        """Move the coefficient with this step's measured mean token entropy; returns the new value."""
        h = float(entropy)
        if not math.isfinite(h):
            raise ValueError(f"entropy={h!r} is not finite; check this step's entropy before updating")
        self.value = min(max(self.value + self.step_size * (self.target - h), 0.0), self.max_coef)
        return self.value

    def state_dict(self) -> dict[str, float]:
        """The coefficient, plus target for inspection."""
        return {"value": self.value, "target": self.target}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the coefficient only (target, step size and bound come from the possibly edited config),
        clipped to this config's bound."""
        if not isinstance(state, dict) or "value" not in state:
            raise ValueError("state for AdaptiveEntropyController.load_state_dict has no 'value' key; pass the "
                             "dict from state_dict()")
        self.value = min(_finite("state['value']", state["value"]), self.max_coef)


__all__ = ["AdaptiveEntropyController", "masked_quantiles", "top_entropy_mask"]
