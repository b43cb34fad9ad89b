"""ResumableOrder and ResumableSampler: seeded, reshuffled per epoch, independent of global RNG, exact across a
resume."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from verl.data import ResumableSampler
from verl.data.sampler import ResumableOrder
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
    with pytest.raises(CheckpointError, match="num_rows: checkpoint 11 vs now 10"):
        s.load_state_dict({**s.state_dict(), "num_rows": 11})
    with pytest.raises(CheckpointError, match="out of range"):
        s.load_state_dict({**s.state_dict(), "position": 99})


def test_order_is_the_documented_permutation_per_stream() -> None:
    """Checkpoints written before the order was shared keep resuming onto the same rows."""
    env_order = ResumableOrder(7, seed=3, stream=(0,))
    assert env_order.take(10) == (np.random.default_rng([3, 0, 0]).permutation(7).tolist()
                                  + np.random.default_rng([3, 0, 1]).permutation(7)[:3].tolist())
    assert env_order.epoch == 1 and env_order.position == 3
    plain = ResumableSampler(7, 7, seed=3)
    assert plain.next_batch() == np.random.default_rng([3, 0]).permutation(7).tolist()
    assert ResumableOrder(7, seed=-1).take(2) == np.random.default_rng([2**64 - 1, 0]).permutation(7)[:2].tolist()


def test_order_take_crosses_epochs_and_resumes_exactly() -> None:
    ref = ResumableOrder(5, seed=11)
    want = ref.take(4) + ref.take(4) + ref.take(9)
    a = ResumableOrder(5, seed=11)
    got = a.take(4) + a.take(4)
    b = ResumableOrder(5, seed=11)
    b.load_state_dict(a.state_dict())
    assert got + b.take(9) == want
    assert sorted(want[:5]) == list(range(5)) and sorted(want[5:10]) == list(range(5))


def test_order_reads_a_batch_of_one_sampler_state() -> None:
    """The SFT row stream used to be a ResumableSampler with batch size 1; its states still load."""
    old = ResumableSampler(6, 1, seed=2)
    first = [old.next_batch()[0] for _ in range(8)]
    new = ResumableOrder(6, seed=2)
    new.load_state_dict(old.state_dict())
    assert first + new.take(4) == ResumableOrder(6, seed=2).take(12)


def test_order_resume_errors() -> None:
    order = ResumableOrder(4, seed=0, what="environment")
    with pytest.raises(CheckpointError, match=r"environment state is missing \['epoch'\]"):
        order.load_state_dict({k: v for k, v in order.state_dict().items() if k != "epoch"})
    with pytest.raises(CheckpointError, match=r"shuffle: checkpoint False vs now True.*Use the same seed"):
        order.load_state_dict({**order.state_dict(), "shuffle": False})
    with pytest.raises(CheckpointError, match="out of range.*corrupt"):
        order.load_state_dict({**order.state_dict(), "epoch": -1})
