"""Per-token quantities read off a language model's logits: log-probabilities of labels and entropy.

All of them work on [..., V] logits in row chunks, forward and backward, and save only the logits
themselves for backward, so that the float32 working copy of a bf16 [B, T, V] tensor never exists in full
(V is 152k for Qwen2.5: one fp32 copy of 8 x 4096 positions is 19 GiB; callers pass the model's bf16
logits as they are). Half-precision logits give float32 results: a bf16 log-probability keeps about 3
significant digits, far too few for the PPO ratio exp(logp - old_logp). A sampling temperature is applied
to each chunk after the upcast, so it rounds in float32 too.
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
    rows: torch.Tensor, fn: Callable[[torch.Tensor, slice], torch.Tensor], out_dtype: torch.dtype,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Apply `fn(chunk_of_rows / temperature, slice)` over chunks of a [N, V] tensor (each chunk upcast to
    `out_dtype` on its own) and stack the results, each written into the output as it comes (a [N, V]
    gradient would exist twice, its chunks and their concatenation, at the backward's peak)."""
    n, vocab = rows.shape
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))

    def upcast(x: torch.Tensor) -> torch.Tensor:
        x = x.to(out_dtype)
        return x if temperature == 1.0 else x / temperature  # out of place: `.to` may return `rows` itself

    if n <= step:
        return fn(upcast(rows), slice(0, n))
    out: torch.Tensor | None = None
    for i in range(0, n, step):
        part = fn(upcast(rows[i : i + step]), slice(i, i + step))
        if out is None:
            out = part.new_empty((n, *part.shape[1:]))
        out[i : i + step] = part
        del part
    assert out is not None
    return out


def _entropy_of_chunk(x: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """-sum p * log p of a chunk of rows, given its log-softmax (overwritten).

    Any p > 0 has log p >= -745 (float64's smallest number), so the floor changes no term with p > 0 and
    turns 0 * -inf (a banned token) into 0, with finite gradients."""
    return -(torch.softmax(x, dim=-1).mul_(logp.clamp_min_(_LOGP_FLOOR))).sum(dim=-1)


class _LabelLogprob(torch.autograd.Function):
    """log_softmax(rows / T)[label] per row of [N, V] rows, in row chunks, with a backward of its own.

    Autograd's graph for ``rows[label] - logsumexp(rows)`` backpropagates through ``exp(rows - lse)``,
    about 3x slower on CPU than a softmax; ``log_softmax(rows).gather(label)`` would keep a full [N, V]
    output for its backward. This keeps only the rows (already alive, in the model's dtype) and recomputes
    the softmax one chunk at a time: d logp[label] / d rows = (onehot(label) - softmax(rows / T)) / T.

    With ``with_entropy`` it also returns each row's entropy (no gradient: for logging), from the same
    log-softmax instead of a second one.
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype,
                with_entropy: bool, temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx.save_for_backward(rows, labels)
        ctx.dtype, ctx.temperature = dtype, temperature
        entropies: list[torch.Tensor] = []

        def chunk(x: torch.Tensor, sl: slice) -> torch.Tensor:
            logp = torch.log_softmax(x, -1)
            picked = logp.gather(-1, labels[sl]).squeeze(-1)
            if with_entropy:
                entropies.append(_entropy_of_chunk(x, logp))
            return picked

        logprobs = _by_row_chunks(rows, chunk, dtype, temperature)
        if not with_entropy:
            return logprobs, None
        entropy = entropies[0] if len(entropies) == 1 else torch.cat(entropies)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor, _entropy_grad: Any) -> tuple[torch.Tensor | None, ...]:
        rows, labels = ctx.saved_tensors

        def chunk(x: torch.Tensor, sl: slice) -> torch.Tensor:
            g = (grad[sl].to(x.dtype) / ctx.temperature).unsqueeze(-1)
            return torch.softmax(x, -1).mul_(g.neg()).scatter_add_(-1, labels[sl], g).to(rows.dtype)

        return _by_row_chunks(rows, chunk, ctx.dtype, ctx.temperature), None, None, None, None


class _Entropy(torch.autograd.Function):
    """Entropy of softmax(rows / T) per row of [N, V] rows, in row chunks, with a backward of its own.

    Autograd through chunked ``log_softmax``/``softmax`` would save each chunk's float32 copy and outputs
    (a full float32 [N, V] in all); this saves only the rows and recomputes one chunk at a time:
    dH / dz = -p * (log p + H) with z = rows / T (the floored log p is exact wherever p > 0)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.dtype, ctx.temperature = dtype, temperature
        return _by_row_chunks(rows, lambda x, _: _entropy_of_chunk(x, torch.log_softmax(x, -1)), dtype,
                              temperature)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (rows,) = ctx.saved_tensors

        def chunk(x: torch.Tensor, sl: slice) -> torch.Tensor:
            logp = torch.log_softmax(x, -1).clamp_min_(_LOGP_FLOOR)
            p = torch.softmax(x, -1)
            entropy = -(p * logp).sum(-1, keepdim=True)
            g = (grad[sl].to(x.dtype) / ctx.temperature).unsqueeze(-1)
            return logp.add_(entropy).mul_(p).mul_(g.neg()).to(rows.dtype)

        return _by_row_chunks(rows, chunk, ctx.dtype, ctx.temperature), None, None


def _check_temperature(temperature: float) -> float:
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}; pass a temperature > 0 (1.0 for the logits as they are)")
    return float(temperature)


def _label_logprobs(logits: torch.Tensor, labels: torch.Tensor, with_entropy: bool,
                    temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    cd = _check_logits(logits)
    temperature = _check_temperature(temperature)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels has shape {tuple(labels.shape)} but logits has shape {tuple(logits.shape)}; "
            f"labels must have the logits' shape without the last (vocabulary) dimension"
        )
    vocab = logits.shape[-1]
    _check_labels(labels, vocab)
    rows = logits.reshape(-1, vocab)
    logprobs, entropy = _LabelLogprob.apply(rows, labels.reshape(-1, 1).long(), cd, with_entropy, temperature)
    return logprobs.reshape(labels.shape), None if entropy is None else entropy.reshape(labels.shape)


def _check_labels(labels: torch.Tensor, vocab: int) -> None:
    """Integer ids inside [0, vocab): an ignore id such as -100 would index out of the row."""
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.dtype.is_complex:
        raise ValueError(f"labels have dtype {labels.dtype}; pass integer token ids (torch.long)")
    if labels.numel() > 0:
        bad = (labels < 0) | (labels >= vocab)
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"labels{list(where)} = {int(labels[where])} is outside the vocabulary [0, {vocab}); "
                f"replace ignore ids such as -100 with a valid id and mask those positions out"
            )


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[label] for every position: [..., V] logits and [...] labels -> [...].

    Stable for any logit scale; never builds the full log-softmax tensor (or a float32 copy of the logits)
    beyond one row chunk.
    """
    return _label_logprobs(logits, labels, False, temperature)[0]


def token_logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, *,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_logprobs` and, from the same log-softmax, :func:`entropy_from_logits`'s values without a
    gradient (entropy for logging: one pass over the [..., V] logits fewer than computing both apart)."""
    logprobs, entropy = _label_logprobs(logits, labels, True, temperature)
    return logprobs, entropy


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at every position: [..., V] -> [...].

    Uses -sum p * log_softmax, both of which subtract the row maximum first, so logits of 1e4 or
    -inf (banned tokens) give exact, finite results and finite gradients.
    """
    cd = _check_logits(logits)
    vocab = logits.shape[-1]
    entropy = _Entropy.apply(logits.reshape(-1, vocab), cd, _check_temperature(temperature))
    return entropy.reshape(logits.shape[:-1])
