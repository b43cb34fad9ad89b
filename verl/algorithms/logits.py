"""Per-token quantities read off a language model's logits: log-probabilities of labels and entropy.

Both work on [..., V] logits in row chunks, so that the float32 working copy of a bf16 [B, T, V] tensor
never exists in full (V is 150k for Qwen: one full copy of an 8 x 4096 batch would be 20 GB).
Half-precision logits give float32 results: a bf16 log-probability keeps about 3 significant digits,
far too few for the PPO ratio exp(logp - old_logp).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Elements of logits processed at once (64 Mi: 256 MiB in float32).
_CHUNK_ELEMENTS = 1 << 26


def _check_logits(logits: torch.Tensor) -> torch.dtype:
    """Validate logits and return the dtype to compute in."""
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; pass logits of shape [..., V] with V >= 1")
    dtype = logits.dtype
    if not dtype.is_floating_point:
        raise ValueError(f"logits have dtype {dtype}; pass floating-point logits")
    return torch.promote_types(dtype, torch.float32)


def _by_row_chunks(
    rows: torch.Tensor, fn: Callable[[torch.Tensor, slice], torch.Tensor], out_dtype: torch.dtype
) -> torch.Tensor:
    """Apply `fn(chunk_of_rows, slice)` over chunks of a [N, V] tensor and concatenate the [n] results."""
    n, vocab = rows.shape
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    if n <= step:
        return fn(rows.to(out_dtype), slice(0, n))
    parts = [fn(rows[i : i + step].to(out_dtype), slice(i, i + step)) for i in range(0, n, step)]
    return torch.cat(parts)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] for every position: [..., V] logits and [...] labels -> [...].

    Computed as logits[label] - logsumexp(logits), which is stable for any logit scale and never builds
    the full log-softmax tensor.
    """
    cd = _check_logits(logits)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels has shape {tuple(labels.shape)} but logits has shape {tuple(logits.shape)}; "
            f"labels must have the logits' shape without the last (vocabulary) dimension"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.dtype.is_complex:
        raise ValueError(f"labels have dtype {labels.dtype}; pass integer token ids (torch.long)")
    vocab = logits.shape[-1]
    if labels.numel() > 0:
        bad = (labels < 0) | (labels >= vocab)
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"labels{list(where)} = {int(labels[where])} is outside the vocabulary [0, {vocab}); "
                f"replace ignore ids such as -100 with a valid id and mask those positions out"
            )
    rows = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1, 1)

    def chunk(x: torch.Tensor, sl: slice) -> torch.Tensor:
        picked = x.gather(-1, flat_labels[sl]).squeeze(-1)
        return picked - torch.logsumexp(x, dim=-1)

    return _by_row_chunks(rows, chunk, cd).reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) at every position: [..., V] -> [...].

    Uses -sum p * log_softmax, where log_softmax subtracts the row maximum first, so logits of 1e4 or
    -inf (banned tokens) give exact, finite results and finite gradients.
    """
    cd = _check_logits(logits)
    vocab = logits.shape[-1]

    def chunk(x: torch.Tensor, sl: slice) -> torch.Tensor:
        logp = torch.log_softmax(x, dim=-1)
        p = logp.exp()
        # p = 0 where logp = -inf; zero logp there so that neither 0 * -inf nor its gradient is NaN.
        safe_logp = torch.where(p > 0, logp, 0)
        return -(p * safe_logp).sum(dim=-1)

    return _by_row_chunks(logits.reshape(-1, vocab), chunk, cd).reshape(logits.shape[:-1])
