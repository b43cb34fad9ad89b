"""A bf16 policy's log-probs never hold a float32 copy of its [B, R, V] logits: not for backward, not at all.

Issue 26, defect 10: a `.float()` on the whole logits before the chunked log-prob function kept a float32
[B, R, V] tensor alive for backward (46 GiB at 8 x 4k tokens of a 152k vocabulary). The chunked functions
upcast (and divide by the temperature) one row chunk at a time, forward and backward; these tests count the
bytes autograd saves and the largest float32 tensor any operation makes, and check the values against a
float64 reference.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import verl.algorithms.logits as logits_mod
from verl.algorithms import entropy_from_logits, token_logprobs, token_logprobs_and_entropy

B, PROMPT, R = 4, 5, 8
TEMPERATURE = 0.7
ROWS_PER_CHUNK = 4


@pytest.fixture(scope="module")
def bf16_model():
    from transformers import AutoModelForCausalLM

    from verl.models.tiny import build_tiny_model

    return AutoModelForCausalLM.from_pretrained(build_tiny_model(seed=0), dtype=torch.bfloat16)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (B, PROMPT + R), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded prompt
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    return ids, mask, positions


class _LargestFloat32(TorchDispatchMode):
    """Records the element count of the largest float32 tensor any operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def _run(model, *, with_entropy: bool, entropy_grad: bool):
    from verl.trainer.forward.logprobs import response_logprobs

    ids, mask, positions = _batch(model.config.vocab_size)
    return response_logprobs(model, ids, mask, positions, R, temperature=TEMPERATURE, with_entropy=with_entropy,
                             entropy_grad=entropy_grad)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_backward_keeps_no_float32_copy_of_the_logits(bf16_model, monkeypatch, entropy_grad):
    """Saved for backward: the bf16 logits (and the model's own activations), no float32 [B, R, V] tensor."""
    vocab = bf16_model.config.vocab_size
    monkeypatch.setattr(logits_mod, "_CHUNK_ELEMENTS", vocab * ROWS_PER_CHUNK)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, entropy = _run(bf16_model, with_entropy=True, entropy_grad=entropy_grad)
    assert logprobs.dtype == torch.float32 and entropy.dtype == torch.float32
    full = B * R * vocab  # elements of the response logits
    # (the model's RMSNorm saves float32 [B, T, hidden] tensors of its own: vocabulary-wide ones are counted)
    fp32_bytes = sum(t.numel() * 4 for t in saved if t.dtype == torch.float32 and t.shape[-1] == vocab)
    assert fp32_bytes == 0, f"{fp32_bytes} bytes of float32 logits saved for backward ({full * 4} in all)"
    # the logits are saved once, in bf16 (shared by the log-probs and a trained entropy)
    assert len({t.untyped_storage().data_ptr() for t in saved if t.dtype == torch.bfloat16 and t.numel() == full}) == 1
    loss = logprobs.sum() + (entropy.sum() if entropy_grad else 0)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in bf16_model.parameters())
    bf16_model.zero_grad(set_to_none=True)


def test_no_operation_makes_a_float32_tensor_larger_than_one_chunk(bf16_model, monkeypatch):
    """Forward and backward (temperature, trained entropy): float32 tensors exist one row chunk at a time."""
    vocab = bf16_model.config.vocab_size
    monkeypatch.setattr(logits_mod, "_CHUNK_ELEMENTS", vocab * ROWS_PER_CHUNK)
    with _LargestFloat32() as probe:
        logprobs, entropy = _run(bf16_model, with_entropy=True, entropy_grad=True)
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
    bf16_model.zero_grad(set_to_none=True)
    assert probe.largest <= vocab * ROWS_PER_CHUNK < B * R * vocab


@pytest.mark.parametrize("rows_per_chunk", [None, 3])
def test_bf16_logits_give_the_float64_log_probs_entropy_and_gradients(monkeypatch, rows_per_chunk):
    """The values are those of float64 math on the same bf16 logits (temperature applied after the upcast):
    log-probs and entropy to float32 rounding; gradients to float32 rounding before their cast to bf16."""
    if rows_per_chunk:
        monkeypatch.setattr(logits_mod, "_CHUNK_ELEMENTS", 17 * rows_per_chunk)
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 5, 17, generator=g, dtype=torch.float64) * 4).to(torch.bfloat16)
    logits[0, 0, :4] = -torch.inf  # banned tokens
    labels = torch.randint(4, 17, (3, 5), generator=g)
    w_lp, w_ent = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g,
                                                                                     dtype=torch.float64)

    ref = logits.double().requires_grad_(True)
    logp = torch.log_softmax(ref / TEMPERATURE, -1)
    ref_lp = logp.gather(-1, labels[..., None]).squeeze(-1)
    ref_ent = -(logp.exp() * logp.clamp_min(-1e4)).sum(-1)
    ref_grads = [torch.autograd.grad((w * v).sum(), ref, retain_graph=True)[0]
                 for w, v in ((w_lp, ref_lp), (w_ent, ref_ent))]

    for dtype, tol in ((torch.bfloat16, 2.0**-8), (torch.float32, 1e-6), (torch.float64, 1e-12)):
        x = logits.to(dtype).requires_grad_(True)
        lp = token_logprobs(x, labels, temperature=TEMPERATURE)
        ent = entropy_from_logits(x, temperature=TEMPERATURE)
        assert lp.dtype == ent.dtype == torch.promote_types(dtype, torch.float32)
        near = 1e-6 if dtype != torch.float64 else 1e-12  # float32 math (half-precision logits compute in it)
        assert torch.allclose(lp.double(), ref_lp.detach(), rtol=near, atol=near)
        assert torch.allclose(ent.double(), ref_ent.detach(), rtol=near, atol=near)
        for w, v, want in zip((w_lp, w_ent), (lp, ent), ref_grads, strict=True):  # rounded once each
            (grad,) = torch.autograd.grad((w * v).sum(), x, retain_graph=True)
            assert grad.dtype == dtype and torch.isfinite(grad).all()
            assert torch.allclose(grad.double(), want, rtol=tol, atol=near * float(want.abs().max())), dtype
        lp2, ent2 = token_logprobs_and_entropy(x.detach(), labels, temperature=TEMPERATURE)
        assert torch.equal(lp2, lp.detach()) and torch.equal(ent2, ent.detach())


def test_a_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature=0.0; pass a temperature > 0"):
        token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), temperature=0.0)
