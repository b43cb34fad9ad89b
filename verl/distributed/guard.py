"""The arrival check in front of every collective: a rank that is elsewhere or absent becomes an error
naming the stage and the missing ranks after a timeout, instead of a collective that waits forever."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from verl.distributed import heartbeat
from verl.errors import DeviceMappingError, DistributedError

T = TypeVar("T")


class CollectiveGuard:
    """Before a collective, every member posts its stage under a per-group sequence number in the store.

    All present with the same stage: go. A member at a different stage: the ranks are running different
    collectives (a deadlock in the making) and all of them raise at once. A member missing after
    `timeout_s`: raise naming the stage and the absent ranks. This works for NCCL too, whose collectives
    otherwise block with no timeout on the host.

    A constant number of store requests per rank and collective, whatever the group's size: each member
    posts its stage (read only to explain a failure), adds one to a counter of its stage and one to the
    arrival counter; the member that brings the arrival counter to the group's size compares its stage's
    count with it and posts the verdict, which every member waits for. Only a failure reads the members'
    posts, to name the missing ranks and their stages.
    """

    _instances = 0

    def __init__(self, timeout_s: float, *, store: Any | None = None, namespace: str | None = None,
                 rank: int | None = None) -> None:
        # A fresh key namespace per guard, so a new guard never reads a previous guard's posts. The
        # default counts constructions, which matches across ranks because every rank builds its guards
        # (RoleGroups.create) in the same order. `rank` (with `store`): this process's rank without a
        # process group, for in-process tests.
        CollectiveGuard._instances += 1
        self.timeout_s = float(timeout_s)
        self.namespace = namespace or f"verl/guard{CollectiveGuard._instances}"
        self._store = store
        self._rank = rank
        self._seq: dict[str, int] = {}
        self._last_stage: dict[str, str] = {}

    def _get_store(self) -> Any:
        if self._store is None:
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def arrive(
        self, stage: str, ranks: tuple[int, ...] | list[int], *, group_name: str | None = None
    ) -> None:
        """Block until every rank in `ranks` reached `stage` (this rank must be one of them)."""
        ranks = tuple(ranks)
        if len(ranks) <= 1 or (self._rank is None and not dist.is_initialized()):
            return
        me = dist.get_rank() if self._rank is None else self._rank
        name = group_name or "g" + "_".join(map(str, ranks))
        seq = self._seq.get(name, 0)
        self._seq[name] = seq + 1
        heartbeat.note(stage=stage, in_collective=True)
        store = self._get_store()
        at = f"{self.namespace}/arrive/{name}/{seq}"
        keys = {r: f"{at}/{r}" for r in ranks}
        try:
            store.set(keys[me], stage)  # read only to explain a failure
            store.add(f"{at}/n:{stage}", 1)  # before the arrival count: the last arriver sees every stage counted
            if store.add(f"{at}/n", 1) == len(ranks):
                same = store.add(f"{at}/n:{stage}", 0) == len(ranks)
                store.set(f"{at}/verdict", "go" if same else "mismatch")
                if seq > 0:  # every member is past call seq-1 (they all counted themselves in at seq)
                    before = f"{self.namespace}/arrive/{name}/{seq - 1}"
                    self._delete(store, f"{before}/n", f"{before}/n:{self._last_stage.get(name, '')}",
                                 f"{before}/verdict")
        except Exception as err:  # DistNetworkError / RuntimeError: the store is gone
            raise self._store_gone(stage, ranks, seq, me, err) from err
        self._wait(store, f"{at}/verdict", stage, ranks, seq, keys, me)
        try:
            verdict = store.get(f"{at}/verdict").decode()
        except Exception as err:
            raise self._store_gone(stage, ranks, seq, me, err) from err
        self._last_stage[name] = stage
        if verdict != "go":
            elsewhere = self._stages(store, keys, stage)
            raise DistributedError(
                f"collective mismatch at call #{seq} of group {list(ranks)}: rank {me} is at stage {stage!r} but "
                f"{elsewhere}. The ranks would deadlock. Fix: make every rank of the group call the same "
                f"stages in the same order (check for rank-dependent branches around the transfer)."
            )
        if seq > 0:  # everyone passed seq-1 once they posted seq; our old key is no longer read
            self._delete(store, f"{self.namespace}/arrive/{name}/{seq - 1}/{me}")
        heartbeat.note(in_collective=False)

    def _wait(self, store: Any, verdict: str, stage: str, ranks: tuple[int, ...], seq: int, keys: dict[int, str],
              me: int) -> None:
        """Wait for the verdict; past `timeout_s` raise naming the missing ranks, with what their heartbeats
        (verl.distributed.heartbeat) last said. A slow rank is no error before then: the heartbeat warns
        about a silent one much earlier."""
        try:
            store.wait([verdict], datetime.timedelta(seconds=self.timeout_s))
        except Exception as err:  # DistStoreError / RuntimeError depending on the store
            try:
                missing = [r for r, k in keys.items() if not store.check([k])]
                elsewhere = self._stages(store, keys, stage)
            except Exception:  # noqa: BLE001 - the store itself is gone with the process that hosted it
                raise self._store_gone(stage, ranks, seq, me, err) from err
            detail = f"; ranks at a different stage: {elsewhere}" if elsewhere else ""
            beat = heartbeat.current()
            seen = (f" Heartbeats: {'; '.join(beat.describe(r) for r in missing)}."
                    if beat is not None and missing else "")
            raise DistributedError(
                f"collective timeout at stage {stage!r} (group {list(ranks)}, call #{seq}) on rank {me}: "
                f"rank(s) {missing} did not arrive within {self.timeout_s:g}s{detail}.{seen} Every rank of the group "
                f"must run the same collectives in the same order. Fix: look at the log of rank(s) {missing} "
                f"(crashed, slower, or skipped this stage); raise devices.timeout_s if they are only slow."
            ) from err

    @staticmethod
    def _store_gone(stage: str, ranks: tuple[int, ...], seq: int, me: int, err: Exception) -> DistributedError:
        return DistributedError(
            f"collective at stage {stage!r} (group {list(ranks)}, call #{seq}) on rank {me}: the "
            f"rendezvous store stopped answering ({type(err).__name__}), so the process hosting it (rank "
            "0, or the torchrun agent) has died. Fix: look at rank 0's log; checkpoints written before "
            "are unaffected (verl ckpt verify).")

    @staticmethod
    def _delete(store: Any, *keys: str) -> None:
        for key in keys:
            try:
                store.delete_key(key)
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

    def clear(self, name: str) -> None:
        """Remove a signal nobody reads any more (the store would otherwise keep one per step for the run)."""
        self._delete(self._get_store(), f"{self.namespace}/signal/{name}")

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
        heartbeat.note(in_collective=True)
        try:
            return fn()
        except (DistributedError, DeviceMappingError):
            raise
        except RuntimeError as err:
            raise DistributedError(
                f"collective at stage {stage!r} (group {list(ranks)}) failed: {err}"
            ) from err
        finally:
            heartbeat.note(in_collective=False)



def role_key(ranks: tuple[int, ...]) -> str:
    """Group name used in the arrival store: the same for every rank of the group."""
    return "g" + "_".join(map(str, ranks))

