"""ResumableSampler: seeded, reshuffled per epoch, independent of global RNG, exact across a resume."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from verl.data import ResumableSampler
from verl.errors import CheckpointError, DataError


def take(s: ResumableSampler, n: int) -> list[list[int]]:
    it = iter(s)
    return [next(it) for _ in range(n)]


def test_epochs_cover_rows_and_reshuffle() -> None:
    s = ResumableSampler(10, 3, seed=1)
    assert len(s) == 3
    batches = take(s, 6)
    e0, e1 = sum(batches[:3], []), sum(batches[3:], [])
    assert len(set(e0)) == 9 and len(set(e1)) == 9  # drop_last: one row left out per epoch
    assert e0 != e1 and s.epoch == 1


def test_no_shuffle_and_keep_last() -> None:
    s = ResumableSampler(5, 2, seed=0, shuffle=False, drop_last=False)
    assert take(s, 4) == [[0, 1], [2, 3], [4], [0, 1]]


def test_resume_sees_same_batches() -> None:
    ref = take(ResumableSampler(17, 4, seed=123), 13)
    a = ResumableSampler(17, 4, seed=123)
    first = take(a, 6)
    state = a.state_dict()
    b = ResumableSampler(17, 4, seed=123)
    b.load_state_dict(state)
    assert first + take(b, 7) == ref


def test_independent_of_global_rng() -> None:
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    x = take(ResumableSampler(50, 5, seed=7), 12)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    np.random.rand(100)
    y = take(ResumableSampler(50, 5, seed=7), 12)
    assert x == y
    assert take(ResumableSampler(50, 5, seed=8), 12) != x


def test_errors() -> None:
    with pytest.raises(DataError, match="the dataset has 3 rows, fewer than one batch of 8"):
        ResumableSampler(3, 8, seed=0)
    s = ResumableSampler(10, 2, seed=0)
    with pytest.raises(CheckpointError, match="num_rows=11 but this run has num_rows=10"):
        s.load_state_dict({**s.state_dict(), "num_rows": 11})
    with pytest.raises(CheckpointError, match="out of range"):
        s.load_state_dict({**s.state_dict(), "position": 99})
