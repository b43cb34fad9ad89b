"""Per-token log-probs and entropy straight from the final hidden states and the output head's weight.

`verl.algorithms.logits` works on logits someone already made: the model's head has by then written a
[tokens, V] tensor for the whole micro-batch (9.7 GB in float32 for one 16k-token response of a 152k
vocabulary) and autograd keeps it for backward. Here the head's projection itself runs one chunk of tokens
at a time, forward and backward: the backward recomputes each chunk's logits from the saved hidden states
([tokens, H], H = 896 for Qwen2.5-0.5B, which the model keeps alive anyway) and the weight, so a [tokens, V]
tensor never exists; at most one chunk of `CHUNK_ELEMENTS` logits (and two float32 tensors of its size) at
a time. The price is one more head projection per chunk in the backward.

The chunks split tokens only. A vocabulary split (an online log-sum-exp over column blocks) would only pay
where a single row of V float32 logits did not fit the chunk budget (V > 64 Mi); it would also cut the head's
matmuls into thinner ones. Rows are independent, so token chunks bound the working set at any length.

Numerics follow the unchunked path: the projection runs in the hidden states' dtype (bf16 logits under
bf16 compute, as the model would make them), each chunk is upcast to float32 (float64 stays float64) and
divided by the temperature after the upcast; the gradients flow back through the same casts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .logits import _CHUNK_ELEMENTS, _LOGP_FLOOR, _check_labels, _check_temperature

CHUNK_ELEMENTS = _CHUNK_ELEMENTS
"""Logits per chunk (64 Mi: 256 MiB in float32); a chunk holds `CHUNK_ELEMENTS // V` tokens (at least 1)."""


def chunk_tokens(vocab: int, chunk_elements: int | None = None) -> int:
    """Tokens per chunk for a vocabulary of `vocab` (the memory plan counts the same chunk)."""
    return max(1, (chunk_elements or CHUNK_ELEMENTS) // max(vocab, 1))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                  temperature: float) -> torch.Tensor:
    """One chunk's logits / temperature in `dtype`: projected in the hidden states' dtype, then upcast."""
    x = torch.nn.functional.linear(hidden, weight, bias).to(dtype)
    return x if temperature == 1.0 else x.div_(temperature)  # in place: the projection's output is fresh


class _HeadLogprob(torch.autograd.Function):
    """(log softmax(h W^T + b) / T)[label], and the entropy of that softmax, per row of [N, H] hidden states.

    Backward, per chunk, with z = (h W^T + b) / T and p = softmax(z):
      d logp[label] / dz = onehot(label) - p,       dH / dz = -p * (log p + H)
    so g_z = g_logp * (onehot - p) - g_H * p * (log p + H), and through the projection (1/T and the casts)
      grad_h = g_z W,  grad_W = sum over chunks g_z^T h,  grad_b = sum over rows g_z.
    The floored log p is exact wherever p > 0 and turns 0 * -inf (a banned token) into 0."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, dtype: torch.dtype, temperature: float, with_entropy: bool,
                rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = hidden.shape[0]
        logprobs = hidden.new_empty(n, dtype=dtype)
        entropy = hidden.new_empty(n, dtype=dtype) if with_entropy else None
        for i in range(0, n, rows):
            x = _chunk_logits(hidden[i : i + rows], weight, bias, dtype, temperature)
            logp = torch.log_softmax(x, -1)
            del x
            logprobs[i : i + rows] = logp.gather(-1, labels[i : i + rows]).squeeze(-1)
            if entropy is not None:
                entropy[i : i + rows] = -torch.linalg.vecdot(logp.exp(), logp.clamp_min_(_LOGP_FLOOR))
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.dtype, ctx.temperature, ctx.rows = dtype, temperature, rows
        ctx.set_materialize_grads(False)  # an output no loss uses gets None: its term is skipped
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, bias, labels = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 5
        if (g_logp is None and g_ent is None) or not (need_h or need_w or need_b):
            return (None, None, None, *none)
        acc = torch.promote_types(weight.dtype, torch.float32)  # a bf16 weight's gradient sums in float32
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        t = ctx.temperature
        for i in range(0, hidden.shape[0], ctx.rows):
            h = hidden[i : i + ctx.rows]
            logp = torch.log_softmax(_chunk_logits(h, weight, bias, ctx.dtype, t), -1)
            p = logp.exp()
            if g_ent is not None:  # g_z = -g_H p (log p + H), written over log p
                logp.clamp_min_(_LOGP_FLOOR)
                ent = -torch.linalg.vecdot(p, logp).unsqueeze(-1)
                gz = logp.add_(ent).mul_(p).mul_(-g_ent[i : i + ctx.rows].to(ctx.dtype).unsqueeze(-1))
                if g_logp is not None:
                    g = g_logp[i : i + ctx.rows].to(ctx.dtype).unsqueeze(-1)
                    gz.addcmul_(p, g, value=-1.0).scatter_add_(-1, labels[i : i + ctx.rows], g)
                del p
            else:  # g_z = g (onehot - p), written over p
                del logp
                g = g_logp[i : i + ctx.rows].to(ctx.dtype).unsqueeze(-1)
                gz = p.mul_(g.neg()).scatter_add_(-1, labels[i : i + ctx.rows], g)
            if t != 1.0:
                gz.div_(t)
            gz = gz.to(hidden.dtype)  # the logits' dtype: the projection's backward runs in it
            if grad_h is not None:
                torch.mm(gz, weight, out=grad_h[i : i + ctx.rows])
            if grad_w is not None:
                if gz.dtype == acc:
                    grad_w.addmm_(gz.T, h)
                else:
                    grad_w += (gz.T @ h).to(acc)
            if grad_b is not None:
                grad_b += gz.sum(0).to(acc)
            del gz
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return (grad_h, grad_w, grad_b, *none)


def head_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_elements: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax((hidden W^T + b) / T)[label] per position, and optionally that softmax's entropy.

    `hidden` [..., H] (the final hidden states, after the last norm), `weight` [V, H] and `bias` [V] of the
    output head, `labels` [...] -> float32 (float64 for float64 inputs) [...] tensors. Both outputs carry
    gradients to `hidden`, `weight` and `bias` (detach the entropy to log it only: its term then costs
    nothing in the backward). Equal to `token_logprobs` / `entropy_from_logits` of the projected logits, up to
    float rounding; never more than one chunk of `chunk_elements` logits (default `CHUNK_ELEMENTS`) at once.
    """
    if hidden.dim() < 1 or not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden has shape {tuple(hidden.shape)} and dtype {hidden.dtype}; pass floating-point "
                         "hidden states of shape [..., H]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"weight has shape {tuple(weight.shape)} but hidden has shape {tuple(hidden.shape)}; "
                         "pass the head's weight as [V, H] with H the hidden states' last dimension")
    vocab = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (vocab,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; the head's bias is [V] = [{vocab}]")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels has shape {tuple(labels.shape)} but hidden has shape {tuple(hidden.shape)}; "
                         "labels must have the hidden states' shape without the last (hidden) dimension")
    _check_labels(labels, vocab)
    temperature = _check_temperature(temperature)
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    rows = chunk_tokens(vocab, chunk_elements)
    logprobs, entropy = _HeadLogprob.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                           labels.reshape(-1, 1).long(), dtype, temperature, with_entropy, rows)
    return logprobs.reshape(labels.shape), None if entropy is None else entropy.reshape(labels.shape)


__all__ = ["CHUNK_ELEMENTS", "chunk_tokens", "head_token_logprobs"]
