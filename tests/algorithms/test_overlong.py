"""DAPO's overlong reward shaping against the paper's piecewise formula written out in float64."""

from __future__ import annotations

import pytest
import torch

from verl.algorithms import overlong_penalty


def reference(length: int, max_length: int, buffer: int, factor: float) -> float:
    expected = max_length - buffer
    if length <= expected:
        return 0.0
    if length <= max_length:
        return factor * (expected - length) / buffer
    return -factor


@pytest.mark.parametrize("max_length, buffer, factor", [(16, 4, 1.0), (16, 16, 0.5), (100, 25, 2.0)])
def test_overlong_penalty_matches_the_piecewise_formula(max_length, buffer, factor):
    lengths = torch.arange(0, max_length + 3)
    got = overlong_penalty(lengths.double(), max_length, buffer, factor)
    want = torch.tensor([reference(int(n), max_length, buffer, factor) for n in lengths], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert overlong_penalty(lengths, max_length, buffer, factor).dtype == torch.float32  # integer lengths


def test_a_buffer_outside_the_length_is_refused():
    with pytest.raises(ValueError, match="buffer must be in 1..max_length=8"):
        overlong_penalty(torch.tensor([3]), 8, 9)
