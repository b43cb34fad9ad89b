"""Advantage estimators: GAE (PPO with a critic), GRPO, RLOO, REINFORCE++ (critic-free).

Advantages are constants for the policy loss, so every estimator runs under no_grad. Token-level
estimators loop over time (a recursion) but are vectorised over the batch; group estimators are fully
vectorised with index_add over `torch.unique` group indices, so group ids need not be sorted or
contiguous. Masked positions are skipped by the recursions: a gap in the middle of a response (e.g. tool
output that the policy did not generate) is invisible to them, and the outputs are 0 there.
"""

from __future__ import annotations

import torch

from .core import _check_same_shape


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; pass a [batch, tokens] tensor")


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value!r} must be in [0, 1]")


def _float_dtype(*tensors: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(result dtype, compute dtype): results keep the inputs' float dtype, math runs in at least float32."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    if not dtype.is_floating_point:
        dtype = torch.float32
    return dtype, torch.promote_types(dtype, torch.float32)


@torch.no_grad()
def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over [B, T] tensors -> (advantages, returns), both [B, T].

    delta_t = r_t + gamma * V(next) - V_t, A_t = delta_t + gamma * lam * A(next), where "next" is the next
    unmasked position (bootstrap 0 after the last one). returns = advantages + values. No whitening here:
    the trainer decides that.
    """
    _check_2d("token_rewards", token_rewards)
    _check_same_shape("token_rewards", token_rewards, values=values, response_mask=response_mask)
    _check_unit("gamma", gamma)
    _check_unit("lam", lam)
    dtype, cd = _float_dtype(token_rewards, values)
    m = response_mask != 0
    r = torch.where(m, token_rewards, 0).to(cd)
    v = torch.where(m, values, 0).to(cd)
    batch, steps = r.shape
    next_value = r.new_zeros(batch)
    next_adv = r.new_zeros(batch)
    columns: list[torch.Tensor] = [r.new_zeros(batch)] * steps
    for t in range(steps - 1, -1, -1):
        mt = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + gamma * lam * next_adv
        next_adv = torch.where(mt, adv_t, next_adv)
        next_value = torch.where(mt, v[:, t], next_value)
        columns[t] = torch.where(mt, adv_t, 0)
    adv = torch.stack(columns, dim=1) if steps else r.clone()
    returns = torch.where(m, adv + v, 0)
    return adv.to(dtype), returns.to(dtype)


@torch.no_grad()
def compute_reinforce_pp_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Discounted return-to-go G_t = r_t + gamma * G(next unmasked position), 0 on masked positions.

    REINFORCE++ uses these returns (usually whitened over the batch) as advantages, without a critic.
    """
    _check_2d("token_rewards", token_rewards)
    _check_same_shape("token_rewards", token_rewards, response_mask=response_mask)
    _check_unit("gamma", gamma)
    dtype, cd = _float_dtype(token_rewards)
    m = response_mask != 0
    r = torch.where(m, token_rewards, 0).to(cd)
    batch, steps = r.shape
    running = r.new_zeros(batch)
    columns: list[torch.Tensor] = [r.new_zeros(batch)] * steps
    for t in range(steps - 1, -1, -1):
        mt = m[:, t]
        running = torch.where(mt, r[:, t] + gamma * running, running)
        columns[t] = torch.where(mt, running, 0)
    out = torch.stack(columns, dim=1) if steps else r.clone()
    return out.to(dtype)


def _group_stats(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype]:
    """Validate, then return per sample: (score - group mean, group size, group sum of squares,
    whether the group's scores differ at all, result dtype).

    The last flag is exact (max != min): the rounded mean of equal scores can differ from them by an
    ulp, which the division by a ~0 std would blow up to an O(1) advantage.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores has shape {tuple(scores.shape)}; pass one score per sample, shape [N]")
    _check_same_shape("scores", scores, group_ids=group_ids)
    if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex or group_ids.dtype == torch.bool:
        raise ValueError(
            f"group_ids have dtype {group_ids.dtype}; pass an integer tensor (e.g. prompt index)"
        )
    dtype, cd = _float_dtype(scores)
    s = scores.to(cd)
    finite = torch.isfinite(s)
    if not bool(finite.all()):
        i = int((~finite).nonzero()[0, 0])
        raise ValueError(
            f"scores[{i}] = {float(s[i])} is not finite; fix the reward function or filter that sample out"
        )
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    mean = s.new_zeros(n_groups).index_add_(0, inverse, s) / counts
    centered = s - mean[inverse]
    sq = s.new_zeros(n_groups).index_add_(0, inverse, centered * centered)
    high = s.new_full((n_groups,), -torch.inf).scatter_reduce_(0, inverse, s, "amax")
    low = s.new_full((n_groups,), torch.inf).scatter_reduce_(0, inverse, s, "amin")
    return centered, counts[inverse], sq[inverse], (high > low)[inverse], dtype


@torch.no_grad()
def compute_grpo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: (r - mean_g) / (std_g + eps) within each group (unbiased std); r - mean_g without `norm_by_std`.

    A group of one sample has nothing to compare with and gets 0, as does every member of a group whose
    scores are all equal (no learning signal).
    """
    if not eps >= 0:
        raise ValueError(f"eps={eps!r} must be >= 0")
    centered, size, sq, varies, dtype = _group_stats(scores, group_ids)
    if norm_by_std:
        std = (sq / (size - 1).clamp(min=1)).sqrt()
        adv = centered / torch.where(varies, std + eps, 1)
    else:
        adv = centered
    return torch.where(varies, adv, 0).to(dtype)


@torch.no_grad()
def compute_rloo_advantages(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i minus the mean of the other members of its group; a group of one gets 0.

    Uses r_i - (S - r_i) / (n - 1) = n / (n - 1) * (r_i - mean), one pass over the groups.
    """
    centered, size, _, varies, dtype = _group_stats(scores, group_ids)
    adv = centered * size / (size - 1).clamp(min=1)
    return torch.where(varies, adv, 0).to(dtype)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's overlong reward shaping: a response whose length reaches into the last `buffer` tokens before
    `max_length` loses `factor` x (how far in) / `buffer`, so 0 up to `max_length - buffer` tokens, then
    linearly down to `-factor` at `max_length` (and beyond, were a length to exceed it). Returns the
    penalty per response (<= 0), in the lengths' float dtype (float32 for integer lengths)."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"buffer must be in 1..max_length={max_length}, got {buffer}")
    dtype = lengths.dtype if lengths.dtype.is_floating_point else torch.float32
    over = (lengths.to(dtype) - (max_length - buffer)).clamp(min=0)
    return -factor * (over / buffer).clamp(max=1)


def place_score_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Turn one score per sequence [B] into token rewards [B, T]: the score sits on the last unmasked token.

    Rows without any unmasked token get no reward at all. Non-float scores (bool, int) become float32.
    """
    _check_2d("response_mask", response_mask)
    if scores.dim() != 1 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores has shape {tuple(scores.shape)} but response_mask has shape {tuple(response_mask.shape)}; "
            f"pass one score per row, shape [{response_mask.shape[0]}]"
        )
    dtype = scores.dtype if scores.dtype.is_floating_point else torch.float32
    s = scores.to(dtype)
    m = response_mask != 0
    batch, steps = m.shape
    if steps == 0:
        return s.new_zeros(batch, 0)
    positions = torch.arange(steps, device=m.device).expand(batch, steps)
    last = torch.where(m, positions, -1).amax(dim=1)
    has = last >= 0
    values = torch.where(has, s, 0).unsqueeze(1)
    return s.new_zeros(batch, steps).scatter(1, last.clamp(min=0).unsqueeze(1), values)
