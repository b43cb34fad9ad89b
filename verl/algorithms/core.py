"""Masked statistics and loss aggregation: the reductions every RL loss shares.

RL batches are full of padding (prompts and responses of different lengths), so every reduction here
takes a mask and ignores whatever lies under it. Masked-out entries are replaced with zero *before* any
arithmetic, so NaN or inf in padding can leak neither into results nor into gradients. A mask is read as
"nonzero = counted"; bool, integer and float masks all work.
"""

from __future__ import annotations

import torch

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def _check_same_shape(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    """Raise a ValueError naming the first tensor whose shape differs from `ref`."""
    for name, t in others.items():
        if tuple(t.shape) != tuple(ref.shape):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
                f"pass {name} with the same shape as {ref_name}"
            )


def _bool_mask(
    mask: torch.Tensor, x: torch.Tensor, x_name: str = "x", mask_name: str = "mask"
) -> torch.Tensor:
    """Check the mask against `x` and return it as a bool tensor."""
    _check_same_shape(x_name, x, **{mask_name: mask})
    return mask if mask.dtype == torch.bool else mask != 0


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name}={value!r} must be > 0")


def _check_agg(mode: str, name: str = "mode") -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"{name}={mode!r} is not a loss aggregation mode; use one of {', '.join(AGG_MODES)}")


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Mean of the unmasked elements of `x` (over `dim`, or over everything when None).

    A slice with no unmasked element has mean 0 rather than NaN, so one empty response cannot poison a
    whole batch's statistics.
    """
    m = _bool_mask(mask, x)
    xs = torch.where(m, x, 0)
    if dim is None:
        total, count = xs.sum(), m.sum()
    else:
        total, count = xs.sum(dim=dim), m.sum(dim=dim)
    return total / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the unmasked elements of `x` (scalar).

    With fewer elements than degrees of freedom (0, or 1 when unbiased) there is no observable spread and
    the variance is 0.
    """
    m = _bool_mask(mask, x)
    xs = torch.where(m, x, 0)
    count = m.sum()
    mean = xs.sum() / count.clamp(min=1)
    sq = torch.where(m, (xs - mean) ** 2, 0).sum()
    dof = count - 1 if unbiased else count
    return sq / dof.clamp(min=1)


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[count, sum, sum of squares] of the unmasked elements, in float64.

    Moments add up: summed over data-parallel shards they are the moments of the whole batch, which is
    how whitening stays a statistic of the global batch however it is split (`whiten_from_moments`).
    """
    m = _bool_mask(mask, x)
    xs = torch.where(m, x, 0).double()
    return torch.stack([m.sum().double(), xs.sum(), (xs * xs).sum()])


def whiten_from_moments(
    x: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean and unbiased var from `masked_moments` (maybe of a larger
    batch); masked positions become 0. `shift_mean=False` adds the mean back."""
    if not eps >= 0:
        raise ValueError(f"eps={eps!r} must be >= 0")
    if tuple(moments.shape) != (3,):
        raise ValueError(f"moments has shape {tuple(moments.shape)}; pass [count, sum, sum of squares] "
                         "from masked_moments")
    m = _bool_mask(mask, x)
    count, total, squares = moments.double().unbind()
    mean = total / count.clamp(min=1)
    var = ((squares - total * mean) / (count - 1).clamp(min=1)).clamp(min=0)
    out = (torch.where(m, x, 0).double() - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0).to(x.dtype)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the unmasked elements (unbiased var); masked positions become 0.

    `shift_mean=False` adds the mean back, which rescales without moving the centre: for rewards or values
    whose sign carries meaning.
    """
    return whiten_from_moments(x, mask, masked_moments(x, mask), shift_mean=shift_mean, eps=eps)


def aggregate_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, norm_len: int | float | None = None
) -> torch.Tensor:
    """Reduce a per-token loss [..., T] to a scalar; the last dimension holds the tokens of a sequence.

    `token-mean` weighs every token equally (long responses dominate); the `seq-mean-*` modes weigh every
    sequence with at least one token equally; `seq-mean-token-sum-norm` divides each sequence's sum by a
    constant `norm_len` (default: T), which removes the length bias of a per-sequence mean (Dr. GRPO).
    An all-masked batch gives 0, still attached to the graph so that backward() works.
    """
    _check_agg(mode)
    m = _bool_mask(mask, loss_mat, "loss_mat", "mask")
    lm = torch.where(m, loss_mat, 0)
    if mode == "token-mean":
        return lm.sum() / m.sum().clamp(min=1)
    if loss_mat.dim() < 1:
        raise ValueError(f"loss_mat is a scalar; mode={mode!r} needs a token dimension, e.g. shape [B, T]")
    tokens = m.sum(dim=-1)
    seq_sum = lm.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / tokens.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq = seq_sum
    else:
        length = loss_mat.shape[-1] if norm_len is None else norm_len
        _check_positive("norm_len", length)
        per_seq = seq_sum / length
    has_tokens = tokens > 0
    return torch.where(has_tokens, per_seq, 0).sum() / has_tokens.sum().clamp(min=1)


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over unmasked tokens: how much of the return the critic predicts.

    1 is a perfect critic, 0 is no better than a constant, negative is worse than a constant. When the
    returns have no variance the ratio is undefined and the result is 0. A 0-dim tensor, for logging.
    """
    _check_same_shape("values", values, returns=returns)
    m = _bool_mask(mask, values, "values", "mask")
    var_y = masked_var(returns, m)
    var_diff = masked_var(torch.where(m, returns, 0) - torch.where(m, values, 0), m)
    return torch.where(var_y > 0, 1 - var_diff / torch.where(var_y > 0, var_y, 1), 0)
