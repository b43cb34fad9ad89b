"""Per-token quantities read off a language model's logits: log-probabilities of labels and entropy.

Both work on [..., V] logits in row chunks, so that the float32 working copy of a bf16 [B, T, V] tensor
never exists in full (V is 150k for Qwen: one full copy of an 8 x 4096 batch would be 20 GB).
Half-precision logits give float32 results: a bf16 log-probability keeps about 3 significant digits,
far too few for the PPO ratio exp(logp - old_logp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

# Elements of logits processed at once (64 Mi: 256 MiB in float32).
_CHUNK_ELEMENTS = 1 << 26
# Below any log-probability of a token with p > 0 in float32 or float64.
_LOGP_FLOOR = -1e4


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
    """Apply `fn(chunk_of_rows, slice)` over chunks of a [N, V] tensor and concatenate the results."""
    n, vocab = rows.shape
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    if n <= step:
        return fn(rows.to(out_dtype), slice(0, n))
    parts = [fn(rows[i : i + step].to(out_dtype), slice(i, i + step)) for i in range(0, n, step)]
    return torch.cat(parts)


def _entropy_of_chunk(x: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """-sum p * log p of a chunk of rows, given its log-softmax (overwritten).

    Any p > 0 has log p >= -745 (float64's smallest number), so the floor changes no term with p > 0 and
    turns 0 * -inf (a banned token) into 0, with finite gradients."""
    return -(torch.softmax(x, dim=-1).mul_(logp.clamp_min_(_LOGP_FLOOR))).sum(dim=-1)


class _LabelLogprob(torch.autograd.Function):
    """log_softmax(rows)[label] per row of [N, V] rows, in row chunks, with a backward of its own.

    Autograd's graph for ``rows[label] - logsumexp(rows)`` backpropagates through ``exp(rows - lse)``,
    about 3x slower on CPU than a softmax; ``log_softmax(rows).gather(label)`` would keep a full [N, V]
    output for its backward. This keeps only the rows (already alive) and recomputes the softmax:
    d logp[label] / d rows = onehot(label) - softmax(rows).

    With ``with_entropy`` it also returns each row's entropy (no gradient: for logging), from the same
    log-softmax instead of a second one.
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx.save_for_backward(rows, labels)
        ctx.dtype = dtype
        entropies: list[torch.Tensor] = []

        def chunk(x: torch.Tensor, sl: slice) -> torch.Tensor:
            logp = torch.log_softmax(x, -1)
            picked = logp.gather(-1, labels[sl]).squeeze(-1)
            if with_entropy:
                entropies.append(_entropy_of_chunk(x, logp))
            return picked

        logprobs = _by_row_chunks(rows, chunk, dtype)
        if not with_entropy:
            return logprobs, None
        entropy = entropies[0] if len(entropies) == 1 else torch.cat(entropies)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor, _entropy_grad: Any) -> tuple[torch.Tensor, None, None, None]:
        rows, labels = ctx.saved_tensors

        def chunk(x: torch.Tensor, sl: slice) -> torch.Tensor:
            g = grad[sl].to(x.dtype).unsqueeze(-1)
            return torch.softmax(x, -1).mul_(g.neg()).scatter_add_(-1, labels[sl], g).to(rows.dtype)

        return _by_row_chunks(rows, chunk, ctx.dtype), None, None, None


def _label_logprobs(logits: torch.Tensor, labels: torch.Tensor,
                    with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
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
    logprobs, entropy = _LabelLogprob.apply(rows, labels.reshape(-1, 1).long(), cd, with_entropy)
    return logprobs.reshape(labels.shape), None if entropy is None else entropy.reshape(labels.shape)


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] for every position: [..., V] logits and [...] labels -> [...].

    Stable for any logit scale; never builds the full log-softmax tensor beyond one row chunk.
    """
    return _label_logprobs(logits, labels, with_entropy=False)[0]


def token_logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` and, from the same log-softmax, :func:`entropy_from_logits`'s values without a
    gradient (entropy for logging: one pass over the [..., V] logits fewer than computing both apart)."""
    logprobs, entropy = _label_logprobs(logits, labels, with_entropy=True)
    return logprobs, entropy


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) at every position: [..., V] -> [...].

    Uses -sum p * log_softmax, both of which subtract the row maximum first, so logits of 1e4 or
    -inf (banned tokens) give exact, finite results and finite gradients.
    """
    cd = _check_logits(logits)
    vocab = logits.shape[-1]

    def chunk(x: torch.Tensor, sl: slice) -> torch.Tensor:  # _entropy_of_chunk's terms, out of place for autograd
        logp = torch.log_softmax(x, dim=-1).clamp_min(_LOGP_FLOOR)
        return -(torch.softmax(x, dim=-1) * logp).sum(dim=-1)

    return _by_row_chunks(logits.reshape(-1, vocab), chunk, cd).reshape(logits.shape[:-1])
