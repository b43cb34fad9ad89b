"""The collective guard's cost in store requests is a constant per rank and collective, whatever the group's
size, and its errors still name the missing ranks and the stages. In-process: one thread per rank over one
in-memory store, so 2..16 ranks take well under a second."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch.distributed as dist

from verl.distributed.guard import CollectiveGuard
from verl.errors import DistributedError


class CountingStore:
    """A store that counts every request, per calling thread (= per rank here)."""

    def __init__(self) -> None:
        self.store = dist.HashStore()
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __getattr__(self, op: str):
        method = getattr(self.store, op)

        def call(*args, **kwargs):
            with self._lock:
                self.counts[threading.current_thread().name] += 1
            return method(*args, **kwargs)

        return call


def run_ranks(world: int, stages, *, calls: int = 1, timeout_s: float = 10.0, absent=()):
    """Each rank r runs `calls` guarded arrivals at stages(r, i); returns the store and each rank's error."""
    store = CountingStore()
    errors: dict[int, str] = {}

    def rank(r: int) -> None:
        guard = CollectiveGuard(timeout_s, store=store, namespace="t", rank=r)
        try:
            for i in range(calls):
                guard.arrive(stages(r, i), tuple(range(world)))
        except DistributedError as err:
            errors[r] = str(err)

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in range(world) if r not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return store, errors


@pytest.mark.parametrize("world", [2, 3, 8, 16])
def test_store_requests_per_rank_and_collective_do_not_grow_with_the_group(world):
    calls = 5
    store, errors = run_ranks(world, lambda r, i: f"reduce:sum#{i}", calls=calls)
    assert errors == {}
    per_rank = [store.counts[f"rank{r}"] / calls for r in range(world)]
    # each rank: post, two adds, wait, get, one delete (6); the last arriver also reads its stage count, posts
    # the verdict and deletes 3 keys (5 more): at most 11 for a rank that arrives last every time, never O(world)
    assert max(per_rank) <= 11, per_rank
    assert sum(store.counts.values()) / calls <= 6 * world + 5, store.counts  # the last arriver's 5, once


def test_a_missing_rank_is_named_with_the_stage():
    _, errors = run_ranks(3, lambda r, i: "ref_logprobs", timeout_s=0.5, absent=(2,))
    for r in (0, 1):
        assert errors[r].startswith("collective timeout at stage 'ref_logprobs' (group [0, 1, 2], call #0) "
                                    f"on rank {r}: rank(s) [2] did not arrive within 0.5s")


def test_ranks_at_different_stages_all_raise_at_once():
    _, errors = run_ranks(3, lambda r, i: "critic_values" if r == 2 else "reward_scores", timeout_s=30)
    assert set(errors) == {0, 1, 2}
    assert "rank 0 is at stage 'reward_scores' but {2: 'critic_values'}" in errors[0]
    assert "rank 2 is at stage 'critic_values' but {0: 'reward_scores', 1: 'reward_scores'}" in errors[2]
    assert "would deadlock" in errors[1]
