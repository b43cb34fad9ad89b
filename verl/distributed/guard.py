"""The arrival check in front of every collective: a rank that is elsewhere or absent becomes an error
naming the stage and the missing ranks after a timeout, instead of a collective that waits forever."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from verl.errors import DeviceMappingError, DistributedError

T = TypeVar("T")


class CollectiveGuard:
    """Before a collective, every member posts (stage) under a per-group sequence number in the store.

    Each rank then waits for the other members' posts. All present with the same stage: go. A post with a
    different stage: the ranks are running different collectives (a deadlock in the making) and all of
    them raise at once. A post missing after `timeout_s`: raise naming the stage and the absent ranks.
    This works for NCCL too, whose collectives otherwise block with no timeout on the host.
    """

    _instances = 0

    def __init__(self, timeout_s: float, *, store: Any | None = None, namespace: str | None = None) -> None:
        # A fresh key namespace per guard, so a new guard never reads a previous guard's posts. The
        # default counts constructions, which matches across ranks because every rank builds its guards
        # (RoleGroups.create) in the same order.
        CollectiveGuard._instances += 1
        self.timeout_s = float(timeout_s)
        self.namespace = namespace or f"verl/guard{CollectiveGuard._instances}"
        self._store = store
        self._seq: dict[str, int] = {}

    def _get_store(self) -> Any:
        if self._store is None:
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def arrive(
        self, stage: str, ranks: tuple[int, ...] | list[int], *, group_name: str | None = None
    ) -> None:
        """Block until every rank in `ranks` reached `stage` (this rank must be one of them)."""
        ranks = tuple(ranks)
        if len(ranks) <= 1 or not dist.is_initialized():
            return
        me = dist.get_rank()
        name = group_name or "g" + "_".join(map(str, ranks))
        seq = self._seq.get(name, 0)
        self._seq[name] = seq + 1
        store = self._get_store()
        prefix = f"{self.namespace}/arrive/{name}"
        store.set(f"{prefix}/{seq}/{me}", stage)
        keys = {r: f"{prefix}/{seq}/{r}" for r in ranks}
        try:
            store.wait(list(keys.values()), datetime.timedelta(seconds=self.timeout_s))
        except Exception as err:  # DistStoreError / RuntimeError depending on the store
            try:
                missing = [r for r, k in keys.items() if not store.check([k])]
                elsewhere = self._stages(store, keys, stage)
            except Exception:  # noqa: BLE001 - the store itself is gone with the process that hosted it
                raise DistributedError(
                    f"collective at stage {stage!r} (group {list(ranks)}, call #{seq}) on rank {me}: the "
                    f"rendezvous store stopped answering ({type(err).__name__}), so the process hosting it (rank "
                    "0, or the torchrun agent) has died. Fix: look at rank 0's log; checkpoints written before "
                    "are unaffected (verl ckpt verify).") from err
            detail = f"; ranks at a different stage: {elsewhere}" if elsewhere else ""
            raise DistributedError(
                f"collective timeout at stage {stage!r} (group {list(ranks)}, call #{seq}) on rank {me}: "
                f"rank(s) {missing} did not arrive within {self.timeout_s:g}s{detail}. Every rank of the group "
                f"must run the same collectives in the same order. Fix: look at the log of rank(s) {missing} "
                f"(crashed, slower, or skipped this stage); raise devices.timeout_s if they are only slow."
            ) from err
        elsewhere = self._stages(store, keys, stage)
        if elsewhere:
            raise DistributedError(
                f"collective mismatch at call #{seq} of group {list(ranks)}: rank {me} is at stage {stage!r} but "
                f"{elsewhere}. The ranks would deadlock. Fix: make every rank of the group call the same "
                f"stages in the same order (check for rank-dependent branches around the transfer)."
            )
        if seq > 0:  # everyone passed seq-1 once they posted seq; our old key is no longer read
            try:
                store.delete_key(f"{prefix}/{seq - 1}/{me}")
            except Exception:  # noqa: BLE001 - cleanup only; stores without delete keep the key
                pass

    @staticmethod
    def _stages(store: Any, keys: dict[int, str], stage: str) -> dict[int, str]:
        out: dict[int, str] = {}
        for r, k in keys.items():
            if store.check([k]):
                seen = store.get(k).decode()
                if seen != stage:
                    out[r] = seen
        return out

    def signal(self, name: str) -> None:
        """Post `name` for any rank to see with `signalled` (a one-sided flag, not a collective)."""
        self._get_store().set(f"{self.namespace}/signal/{name}", "1")

    def signalled(self, name: str) -> bool:
        """Whether some rank posted `name`; never waits."""
        return bool(self._get_store().check([f"{self.namespace}/signal/{name}"]))

    def run(
        self,
        stage: str,
        ranks: tuple[int, ...] | list[int],
        fn: Callable[[], T],
        *,
        group_name: str | None = None,
    ) -> T:
        """Arrival check, then the collective `fn`; the stage name is added to any error it raises."""
        self.arrive(stage, ranks, group_name=group_name)
        try:
            return fn()
        except (DistributedError, DeviceMappingError):
            raise
        except RuntimeError as err:
            raise DistributedError(
                f"collective at stage {stage!r} (group {list(ranks)}) failed: {err}"
            ) from err



def role_key(ranks: tuple[int, ...]) -> str:
    """Group name used in the arrival store: the same for every rank of the group."""
    return "g" + "_".join(map(str, ranks))

