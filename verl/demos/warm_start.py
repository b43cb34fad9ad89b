"""Work that only the actor's ranks do before an RL run, such as the demos' supervised warm start, on any placement.

The warm start trains the RL trainer's policy (`SFTTrainer(parts=trainer.parts)`, data-parallel over the
actor's ranks) and probes it with `trainer.evaluate` (the actor's ranks answer the rows among themselves), so
on a split placement only the actor's ranks run it. The other ranks (the rollout ranks of an asynchronous run,
a reference or critic placed apart) wait by polling the rendezvous store, not inside a collective, whose
`devices.timeout_s` a long warm start could outlast; then every rank gets the result the way metrics reach
every rank (`Placement.mean_over_owners`), so all ranks leave here together and call the run's collectives in
the same order. The rollout ranks get the warmed weights by the first step's delivery
(`AsyncRollout.next_batch`); a reference or critic keeps the initial weights, as in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from verl.errors import DistributedError

POLL_S = 0.1  # how often a waiting rank asks the store whether the actor's ranks are done


def first_actor_rank(trainer: Any) -> int:
    """The rank that reports what the actor's ranks do (rank 0 unless the actor sits elsewhere)."""
    return trainer.groups.ranks("actor")[0] if trainer.groups is not None else 0


def on_actor_ranks(trainer: Any, work: Callable[[], dict[str, float]], *,
                   stage: str = "warm_start") -> dict[str, float]:
    """`work()` on the actor's ranks (every rank when the roles are colocated); its numbers (the same on every
    actor rank: sums and means over them) on every rank. A rank without the actor waits for the first actor rank
    to finish, and raises if an actor rank failed instead of waiting for a result that never comes."""
    placement = trainer.placement
    if not placement.split:
        return work()
    guard = trainer.groups.guard
    done, failed = f"{stage}/done", f"{stage}/failed"
    result: dict[str, float] = {}
    if placement.holds("actor"):
        try:
            result = work()
        except BaseException:
            guard.signal(failed)
            raise
        if trainer.rank == first_actor_rank(trainer):
            guard.signal(done)
    else:
        while not guard.signalled(done):
            if guard.signalled(failed):
                actor = list(trainer.groups.ranks("actor"))
                raise DistributedError(f"{stage}: rank {trainer.rank} waited for the actor's rank(s) {actor}, and one "
                                       f"of them failed. Fix: see the error of rank(s) {actor}, the cause")
            time.sleep(POLL_S)
    return placement.mean_over_owners(result)


__all__ = ["first_actor_rank", "on_actor_ranks"]
