"""head_token_logprobs (log-probs and entropy from hidden states and the head's weight, in token chunks)
against a float64 reference that projects the whole [N, V] logits at once, values and gradients."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from verl.algorithms import head_token_logprobs, token_logprobs, token_logprobs_and_entropy
from verl.algorithms.head_logprobs import chunk_tokens

B, T, H, V = 3, 7, 6, 13
TEMPERATURE = 0.7


def _inputs(seed: int = 0, dtype=torch.float64, bias: bool = True, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64) * scale
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    w_lp = torch.randn(B, T, generator=g, dtype=torch.float64)
    w_ent = torch.randn(B, T, generator=g, dtype=torch.float64)

    def cast(x):
        return None if x is None else x.to(dtype).requires_grad_(True)

    return cast(hidden), cast(weight), cast(b), labels, w_lp.to(dtype), w_ent.to(dtype)


def _reference(hidden, weight, bias, labels, temperature):
    """The whole logits at once, in float64: z = (h W^T + b) / T, log-softmax, gather; H = -sum p log p."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    logp = torch.log_softmax(z / temperature, -1)
    lp = logp.gather(-1, labels[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp.clamp_min(-1e4)).sum(-1)
    return lp, ent


def _grads(loss, tensors):
    wanted = [t for t in tensors if t is not None and t.requires_grad]
    return torch.autograd.grad(loss, wanted, retain_graph=True)


@pytest.mark.parametrize("rows", [1, 4, B * T, 1000])  # one token per chunk, ragged chunks, one chunk
@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_equal_the_whole_projection_in_float64(rows, temperature, bias):
    hidden, weight, b, labels, w_lp, w_ent = _inputs(bias=bias)
    ref_lp, ref_ent = _reference(hidden, weight, b, labels, temperature)
    lp, ent = head_token_logprobs(hidden, weight, labels, bias=b, temperature=temperature, with_entropy=True,
                                  chunk_elements=rows * V)
    assert lp.dtype == ent.dtype == torch.float64 and lp.shape == ent.shape == (B, T)
    assert torch.allclose(lp, ref_lp, rtol=0, atol=1e-10) and torch.allclose(ent, ref_ent, rtol=0, atol=1e-10)
    for loss, ref_loss in (((w_lp * lp).sum(), (w_lp * ref_lp).sum()),  # log-probs alone
                           ((w_ent * ent).sum(), (w_ent * ref_ent).sum()),  # the entropy term alone
                           ((w_lp * lp + w_ent * ent).sum(), (w_lp * ref_lp + w_ent * ref_ent).sum())):
        got, want = _grads(loss, (hidden, weight, b)), _grads(ref_loss, (hidden, weight, b))
        for g, w in zip(got, want, strict=True):
            assert torch.allclose(g, w, rtol=0, atol=1e-10), float((g - w).abs().max())


def test_gradcheck_with_finite_differences():
    hidden, weight, b, labels, _, _ = _inputs(seed=1)
    hidden, weight, b = hidden[:1, :5].detach().requires_grad_(), weight.detach().requires_grad_(), \
        b.detach().requires_grad_()
    labels = labels[:1, :5]

    def both(h, w, bb):
        return head_token_logprobs(h, w, labels, bias=bb, temperature=TEMPERATURE, with_entropy=True,
                                   chunk_elements=2 * V)

    assert torch.autograd.gradcheck(both, (hidden, weight, b))


def test_entropy_for_logging_leaves_the_log_prob_gradient_alone():
    hidden, weight, b, labels, w_lp, _ = _inputs(seed=2)
    lp, ent = head_token_logprobs(hidden, weight, labels, bias=b, with_entropy=True, chunk_elements=3 * V)
    lp_only, none = head_token_logprobs(hidden, weight, labels, bias=b, chunk_elements=3 * V)
    assert none is None and torch.equal(lp, lp_only)
    got = _grads((w_lp * lp).sum() + 0 * ent.detach().sum(), (hidden, weight, b))
    want = _grads((w_lp * lp_only).sum(), (hidden, weight, b))
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_banned_tokens_and_large_logits_stay_exact_and_finite():
    """A -inf bias (banned ids) and hidden states scaled to logits of ~1e3: the floored log p."""
    hidden, weight, b, labels, w_lp, w_ent = _inputs(seed=3, scale=300.0)
    with torch.no_grad():
        b[:3] = -math.inf
    labels = labels.clamp_min(3)
    ref_lp, ref_ent = _reference(hidden, weight, b, labels, TEMPERATURE)
    lp, ent = head_token_logprobs(hidden, weight, labels, bias=b, temperature=TEMPERATURE, with_entropy=True,
                                  chunk_elements=4 * V)
    assert torch.allclose(lp, ref_lp, rtol=1e-12, atol=1e-10) and torch.allclose(ent, ref_ent, atol=1e-10)
    grads = _grads((w_lp * lp + w_ent * ent).sum(), (hidden, weight, b))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[2][:3], torch.zeros(3, dtype=torch.float64))  # p = 0: no gradient to a banned id


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_still_do():
    hidden, weight, b, labels, w_lp, w_ent = _inputs(seed=4)
    weight, b = weight.detach(), b.detach()
    lp, ent = head_token_logprobs(hidden, weight, labels, bias=b, with_entropy=True, chunk_elements=5 * V)
    ref_lp, ref_ent = _reference(hidden, weight, b, labels, 1.0)
    (got,) = _grads((w_lp * lp + w_ent * ent).sum(), (hidden,))
    (want,) = _grads((w_lp * ref_lp + w_ent * ref_ent).sum(), (hidden,))
    assert torch.allclose(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_equals_the_logits_path(dtype, tol):
    """The projection runs in the model's dtype and each chunk is upcast, as the unchunked path upcasts the
    model's logits: float32 results, gradients in the inputs' dtype."""
    hidden, weight, b, labels, w_lp, w_ent = _inputs(seed=5, dtype=dtype)
    lp, ent = head_token_logprobs(hidden, weight, labels, bias=b, temperature=TEMPERATURE, with_entropy=True,
                                  chunk_elements=4 * V)
    logits = torch.nn.functional.linear(hidden, weight, b)
    want_lp, want_ent = token_logprobs_and_entropy(logits, labels, temperature=TEMPERATURE)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp, want_lp, atol=1e-5) and torch.allclose(ent.detach(), want_ent, atol=1e-5)
    got = _grads((w_lp.float() * lp + w_ent.float() * ent).sum(), (hidden, weight, b))
    assert [g.dtype for g in got] == [dtype] * 3
    ref_lp, ref_ent = _reference(hidden, weight, b, labels, TEMPERATURE)
    want = _grads((w_lp.double() * ref_lp + w_ent.double() * ref_ent).sum(), (hidden, weight, b))
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g.double(), w.to(dtype).double(), rtol=tol, atol=tol * float(w.abs().max()))
    assert torch.equal(token_logprobs(logits, labels, temperature=TEMPERATURE), want_lp)


class _Largest(TorchDispatchMode):
    """The element count of the largest tensor any operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_larger_than_one_chunk_or_the_weight_exists_forward_or_backward():
    g = torch.Generator().manual_seed(6)
    n, h, v, rows = 64, 8, 50, 4  # N x V = 3200 logits in all; a chunk is 200, the weight 400, hidden 512
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    with _Largest() as probe:
        lp, ent = head_token_logprobs(hidden, weight, labels, temperature=0.9, with_entropy=True,
                                      chunk_elements=rows * v)
        (lp.sum() + 0.1 * ent.sum()).backward()
    assert probe.largest <= max(v * h, n * h, rows * v) < n * v


def test_chunk_tokens():
    assert chunk_tokens(151_936) == (1 << 26) // 151_936 == 441
    assert chunk_tokens(10**9) == 1 and chunk_tokens(13, 13 * 4) == 4


def test_errors_name_the_argument():
    hidden, weight, labels = torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"weight has shape \(5, 3\) but hidden has shape \(2, 3, 4\)"):
        head_token_logprobs(hidden, torch.zeros(5, 3), labels)
    with pytest.raises(ValueError, match=r"bias has shape \(4,\); the head's bias is \[V\] = \[5\]"):
        head_token_logprobs(hidden, weight, labels, bias=torch.zeros(4))
    with pytest.raises(ValueError, match=r"labels has shape \(2, 4\) but hidden has shape \(2, 3, 4\)"):
        head_token_logprobs(hidden, weight, torch.zeros(2, 4, dtype=torch.long))
    labels[1, 2] = -100
    with pytest.raises(ValueError, match=r"labels\[1, 2\] = -100 is outside the vocabulary \[0, 5\)"):
        head_token_logprobs(hidden, weight, labels)
    with pytest.raises(ValueError, match="temperature=0.0; pass a temperature > 0"):
        head_token_logprobs(hidden, weight, labels.clamp_min(0), temperature=0.0)
    with pytest.raises(ValueError, match="pass floating-point hidden states"):
        head_token_logprobs(torch.zeros(2, 3, 4, dtype=torch.long), weight, labels.clamp_min(0))
