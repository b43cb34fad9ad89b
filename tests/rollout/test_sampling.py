"""One sampling step against an independent float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from verl.rollout import filtered_logprobs, sample_from_logprobs, sample_step


def reference_logprobs(row: list[float], temperature: float, top_k: int | None, top_p: float) -> list[float]:
    """Temperature, then top-k, then top-p (smallest set reaching top_p), in plain float64 Python."""
    scaled = [x / temperature for x in row]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order)
    if top_k:
        kth = scaled[order[min(top_k, len(order)) - 1]]
        keep = {i for i in keep if scaled[i] >= kth}
    if top_p < 1.0:
        m = max(scaled[i] for i in keep)
        z = sum(math.exp(scaled[i] - m) for i in keep)
        mass, nucleus = 0.0, set()
        for i in order:
            if i not in keep:
                continue
            if mass >= top_p:
                break
            nucleus.add(i)
            mass += math.exp(scaled[i] - m) / z
        keep = nucleus
    m = max(scaled[i] for i in keep)
    log_z = m + math.log(sum(math.exp(scaled[i] - m) for i in keep))
    return [scaled[i] - log_z if i in keep else -math.inf for i in range(len(row))]


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, None, 1.0), (0.7, None, 1.0), (1.3, 5, 1.0), (1.0, None, 0.8), (0.5, 10, 0.6), (2.0, 1, 1.0),
    (1.0, 0, 0.3),
])
def test_filtered_logprobs_matches_float64_reference(temperature, top_k, top_p):
    logits = torch.randn(4, 23, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    got = filtered_logprobs(logits, temperature, top_k, top_p)
    for r in range(logits.shape[0]):
        want = torch.tensor(reference_logprobs(logits[r].tolist(), temperature, top_k, top_p), dtype=torch.float64)
        assert torch.equal(torch.isinf(got[r]), torch.isinf(want))
        finite = ~torch.isinf(want)
        torch.testing.assert_close(got[r][finite], want[finite], rtol=0, atol=1e-12)


def test_filtered_logprobs_upcasts_low_precision():
    logits = torch.randn(2, 10).to(torch.bfloat16)
    assert filtered_logprobs(logits, 1.0).dtype == torch.float32


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over bins with expected count >= 5 (the rest merged into one bin)."""
    total = counts.sum().item()
    expected = probs * total
    big = expected >= 5
    obs = counts[big].tolist() + [counts[~big].sum().item()]
    exp = expected[big].tolist() + [expected[~big].sum().item()]
    pairs = [(o, e) for o, e in zip(obs, exp, strict=True) if e > 0]
    return sum((o - e) ** 2 / e for o, e in pairs), len(pairs) - 1


# Upper 0.1% quantile of chi-square with df degrees of freedom (Wilson-Hilferty), to keep scipy out.
def chi2_critical(df: int, z: float = 3.09) -> float:
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_inverse_cdf_sampling_has_the_softmax_distribution():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.15, 0.1, 0.0, 0.05], dtype=torch.float64)
    draws = 40000
    logp = probs.log().expand(draws, -1)
    tokens = sample_from_logprobs(logp, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    assert counts[1] == 0 and counts[5] == 0  # zero-probability tokens are never drawn
    stat, df = chi_square(counts, probs)
    assert stat < chi2_critical(df), (stat, df, counts)


def test_sampling_rejects_a_wrong_distribution():
    """The chi-square check above has power: a shifted distribution fails it."""
    probs = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64)
    tokens = sample_from_logprobs(probs.log().expand(40000, -1), torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=4).double()
    stat, df = chi_square(counts, torch.tensor([0.45, 0.25, 0.2, 0.1], dtype=torch.float64))
    assert stat > chi2_critical(df)


def test_sample_step_greedy_is_argmax_with_untempered_logprob():
    logits = torch.randn(5, 17, generator=torch.Generator().manual_seed(1))
    tokens, logp = sample_step(logits, temperature=0.0)
    assert torch.equal(tokens, logits.argmax(-1))
    ref = logits.double().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logp.double(), ref, rtol=0, atol=1e-6)


def test_sample_step_logprob_is_that_of_the_filtered_distribution():
    logits = torch.randn(64, 31, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    tokens, logp = sample_step(logits, 0.8, 4, 0.9, torch.Generator().manual_seed(5))
    for r in range(64):
        ref = reference_logprobs(logits[r].tolist(), 0.8, 4, 0.9)
        assert ref[tokens[r]] > -math.inf
        assert abs(logp[r].item() - ref[tokens[r]]) < 1e-12


def test_sample_step_float32_logprob_agrees_with_float64_log_softmax():
    """The sampled token's log-prob is taken as log(softmax) at that token: within float32 rounding of the
    float64 log_softmax, also for unlikely tokens of widely spread logits."""
    logits = torch.randn(4096, 100, generator=torch.Generator().manual_seed(3)) * 4
    tokens, logp = sample_step(logits, 1.0, generator=torch.Generator().manual_seed(4))
    ref = logits.double().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    assert logp.dtype == torch.float32 and ref.min() < -9  # some draws are unlikely tokens
    torch.testing.assert_close(logp.double(), ref, rtol=1e-6, atol=2e-6)


def test_seeded_generator_reproduces_draws():
    logp = torch.randn(8, 50).log_softmax(-1)
    a = sample_from_logprobs(logp, torch.Generator().manual_seed(7))
    b = sample_from_logprobs(logp, torch.Generator().manual_seed(7))
    c = sample_from_logprobs(logp, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
