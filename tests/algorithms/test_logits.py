"""token_logprobs and entropy_from_logits against float64 references, including extreme logits."""

from __future__ import annotations

import math

import pytest
import torch

import verl.algorithms.logits as logits_mod
from verl.algorithms import entropy_from_logits, token_logprobs, token_logprobs_and_entropy


def ref_logprob(row: list[float], label: int) -> float:
    mx = max(row)
    return row[label] - mx - math.log(sum(math.exp(v - mx) for v in row))


def ref_entropy(row: list[float]) -> float:
    mx = max(row)
    z = sum(math.exp(v - mx) for v in row)
    ent = 0.0
    for v in row:
        p = math.exp(v - mx) / z
        if p > 0:
            ent -= p * math.log(p)
    return ent


def _logits(scale: float, seed: int = 0, shape=(2, 3, 11)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4])
def test_token_logprobs_matches_reference(scale):
    logits = _logits(scale)
    labels = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(1))
    got = token_logprobs(logits, labels)
    got32 = token_logprobs(logits.float(), labels)
    assert got.shape == (2, 3) and got32.dtype == torch.float32
    for b in range(2):
        for t in range(3):
            want = ref_logprob(logits[b, t].tolist(), int(labels[b, t]))
            assert got[b, t].item() == pytest.approx(want, rel=1e-12, abs=1e-9)
            # float32 rounds the logits themselves: allow the relative error of their scale
            assert got32[b, t].item() == pytest.approx(want, rel=1e-5, abs=1e-5 + 2e-7 * scale)
            assert math.isfinite(got32[b, t].item())


def test_token_logprobs_hand_case():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -math.inf, 0.0]])
    got = token_logprobs(logits, torch.tensor([2, 0]))
    assert got.tolist() == pytest.approx([math.log(0.25), math.log(3.0 / 5.0)])


def test_token_logprobs_bf16_gives_float32_and_gradients():
    logits = _logits(3.0).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(2))
    got = token_logprobs(logits, labels)
    assert got.dtype == torch.float32
    got.sum().backward()
    # d logp[label] / d logits = onehot(label) - softmax
    want = torch.nn.functional.one_hot(labels, 11).float() - torch.softmax(logits.detach().float(), -1)
    assert torch.allclose(logits.grad.float(), want, atol=1e-2)


def test_chunked_path_equals_single_chunk(monkeypatch):
    logits = _logits(5.0, shape=(3, 7, 13)).requires_grad_(True)
    labels = torch.randint(0, 13, (3, 7), generator=torch.Generator().manual_seed(3))
    whole_lp, whole_ent = token_logprobs(logits, labels), entropy_from_logits(logits)
    (g_whole,) = torch.autograd.grad((whole_lp.sum() + whole_ent.sum()), logits)
    monkeypatch.setattr(logits_mod, "_CHUNK_ELEMENTS", 13 * 4)  # 4 rows per chunk, 21 rows
    lp, ent = token_logprobs(logits, labels), entropy_from_logits(logits)
    (g,) = torch.autograd.grad((lp.sum() + ent.sum()), logits)
    assert torch.equal(lp, whole_lp) and torch.equal(ent, whole_ent) and torch.equal(g, g_whole)


@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4])
def test_entropy_matches_reference(scale):
    logits = _logits(scale, seed=4)
    got = entropy_from_logits(logits)
    got32 = entropy_from_logits(logits.float())
    assert got.shape == (2, 3) and got32.dtype == torch.float32
    for b in range(2):
        for t in range(3):
            want = ref_entropy(logits[b, t].tolist())
            assert got[b, t].item() == pytest.approx(want, rel=1e-10, abs=1e-12)
            assert got32[b, t].item() == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_entropy_hand_cases_and_extremes():
    assert entropy_from_logits(torch.zeros(8)).item() == pytest.approx(math.log(8))
    assert entropy_from_logits(torch.tensor([1e30, 0.0, -1e30])).item() == 0.0
    two = torch.tensor([0.0, 0.0, -math.inf, -math.inf], requires_grad=True)
    ent = entropy_from_logits(two)
    ent.backward()
    assert ent.item() == pytest.approx(math.log(2))
    assert torch.isfinite(two.grad).all()
    big = torch.full((2, 5), 1e4, dtype=torch.float32)
    big[0, 0] = 1e4 + 1.0
    got = entropy_from_logits(big)
    z = math.e + 4
    assert got[0].item() == pytest.approx(
        -(math.e / z) * math.log(math.e / z) - 4 / z * math.log(1 / z), rel=1e-5
    )
    assert got[1].item() == pytest.approx(math.log(5), rel=1e-6)


def test_entropy_gradient_matches_finite_differences():
    logits = _logits(2.0, seed=5, shape=(2, 5)).requires_grad_(True)
    assert torch.autograd.gradcheck(entropy_from_logits, (logits,))
    labels = torch.tensor([1, 4])
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, labels), (logits,))


@pytest.mark.parametrize("rows_per_chunk", [None, 4])
def test_logprobs_with_entropy_from_one_log_softmax_equal_the_two_apart(monkeypatch, rows_per_chunk):
    """The update's logging entropy rides on the log-probs' log-softmax: the same bits as computing both
    apart, the log-probs' gradient unchanged, no gradient through the entropy; extremes stay exact."""
    if rows_per_chunk:
        monkeypatch.setattr(logits_mod, "_CHUNK_ELEMENTS", 13 * rows_per_chunk)
    logits = _logits(5.0, seed=6, shape=(3, 7, 13))
    logits[0, 0, :3] = -math.inf  # banned tokens
    logits[1, 1] *= 1e4
    labels = torch.randint(3, 13, (3, 7), generator=torch.Generator().manual_seed(7))
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        x = logits.to(dtype).requires_grad_(True)
        lp, ent = token_logprobs_and_entropy(x, labels)
        assert torch.equal(lp, token_logprobs(x, labels))
        assert torch.equal(ent, entropy_from_logits(x.detach())) and not ent.requires_grad
        assert torch.isfinite(ent).all()
        (g,) = torch.autograd.grad(lp.sum(), x)
        (g_alone,) = torch.autograd.grad(token_logprobs(x, labels).sum(), x)
        assert torch.equal(g, g_alone)
        if dtype == torch.float64:  # and the values are the entropy, -inf and 1e4-scaled rows included
            for b, t in ((0, 0), (1, 1), (2, 6)):
                assert ent[b, t].item() == pytest.approx(ref_entropy(logits[b, t].tolist()), rel=1e-10, abs=1e-12)


def test_errors_name_the_argument():
    logits = torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match=r"labels has shape \(2, 4\) but logits has shape \(2, 3, 5\)"):
        token_logprobs(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels have dtype torch.float32; pass integer token ids"):
        token_logprobs(logits, torch.zeros(2, 3))
    labels = torch.zeros(2, 3, dtype=torch.long)
    labels[1, 2] = -100
    with pytest.raises(ValueError, match=r"labels\[1, 2\] = -100 is outside the vocabulary \[0, 5\)"):
        token_logprobs(logits, labels)
    labels[1, 2] = 5
    with pytest.raises(ValueError, match=r"labels\[1, 2\] = 5 is outside"):
        token_logprobs(logits, labels)
    with pytest.raises(ValueError, match="logits have dtype torch.int64; pass floating-point logits"):
        entropy_from_logits(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits has shape \(2, 0\); pass logits of shape \[..., V\]"):
        entropy_from_logits(torch.zeros(2, 0))
