"""Heartbeats: a rank that stops answering (SIGSTOP, swapped out, a hang that holds the GIL) is named within
`devices.heartbeat_s`, long before a collective gives up on it at `devices.timeout_s`.

Every rank runs one daemon thread. Every `interval_s` it posts its beat (a counter, what the main thread was
doing: the collective stage the guard last named, the training step) under its own key in the rendezvous
store, and reads every other rank's beat in one request. A beat that has not changed for `heartbeat_s` on
this rank's own clock (no clocks are compared across hosts) is a silent rank: every other rank prints one
warning naming it, its last stage and step, its pid and host, and says so again when it answers. Silence
only warns: the collective that needs the rank still fails at `devices.timeout_s`, with the heartbeat's
view of the missing ranks in its message (`CollectiveGuard`).

The thread talks to the store over its own connection (`Store.clone`): the main thread's connection is
busy for as long as a guard waits, and a store request that hangs (its host stopped) times out after
`heartbeat_s` instead of stalling the monitor. The main thread only sets two attributes (`note`): no I/O.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass
class Beat:
    """What this process last heard from one rank."""

    n: int
    stage: str | None
    in_collective: bool
    step: int | None
    pid: int
    host: str
    exited: bool
    seen_at: float  # this process's monotonic clock when `n` last changed

    def doing(self) -> str:
        where = "before any guarded collective"
        if self.stage is not None:
            where = (f"waiting in collective {self.stage!r}" if self.in_collective
                     else f"past its last collective {self.stage!r}")
        step = f", step {self.step}" if self.step is not None else ""
        return f"{where}{step}"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Heartbeat:
    """One rank's beat publisher and monitor of the other ranks' beats (see the module docstring)."""

    def __init__(
        self,
        heartbeat_s: float,
        *,
        store: Any | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        timeout_s: float | None = None,
        interval_s: float | None = None,
        namespace: str = "verl/heartbeat",
        log: Callable[[str], None] = _stderr,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.heartbeat_s = float(heartbeat_s)
        self.timeout_s = timeout_s
        # a few beats per heartbeat_s, so one late beat is no silence; at most every 5 s
        self.interval_s = float(interval_s) if interval_s is not None else min(5.0, self.heartbeat_s / 4)
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        self.namespace = namespace
        self._log = log
        self._clock = clock
        self._base_store = store
        self._store: Any | None = None
        self._keys = [f"{namespace}/{r}" for r in range(self.world_size)]
        self._all_posted = False
        self._n = 0
        self._pid, self._host = os.getpid(), socket.gethostname()
        self.beats: dict[int, Beat] = {}
        self.silent: set[int] = set()
        self.messages: list[str] = []
        self._store_failing_since: float | None = None
        self._store_warned = False
        # written by the main thread (note), read by the beat thread: single attribute stores, no lock needed
        self.stage: str | None = None
        self.in_collective = False
        self.step: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- main thread
    def note(self, *, stage: str | None = None, in_collective: bool | None = None, step: int | None = None) -> None:
        """Record what this rank is doing, for its next beat. No I/O: the guard calls it on every collective."""
        if stage is not None:
            self.stage = stage
        if in_collective is not None:
            self.in_collective = in_collective
        if step is not None:
            self.step = step

    def start(self) -> Heartbeat:
        self.beat()  # the first beat now, so the others see this rank before the first interval ends
        self._thread = threading.Thread(target=self._run, name=f"verl-heartbeat-rank{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Post a last beat that says this rank exited (no warning about it then), and end the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1)
            self._thread = None
        try:
            self._post(exited=True)
        except Exception:  # noqa: BLE001 - the store may be gone already at exit
            pass

    def describe(self, rank: int) -> str:
        """What the heartbeat knows about `rank`, for an error message: silent for how long, doing what."""
        beat = self.beats.get(rank)
        if beat is None:
            return f"rank {rank}: no heartbeat seen"
        age = self._clock() - beat.seen_at
        if beat.exited:
            return f"rank {rank}: exited (its last beat: {beat.doing()})"
        state = "silent" if age > self.heartbeat_s else "alive"
        return (f"rank {rank} (pid {beat.pid} on {beat.host}): {state}, last heartbeat {age:.0f}s ago, "
                f"{beat.doing()}")

    # ---------------------------------------------------------------- beat thread
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception as err:  # noqa: BLE001 - a monitor must not die of a malformed beat
                self._say(f"[verl heartbeat] rank {self.rank}: heartbeat error {type(err).__name__}: {err}")

    def _get_store(self) -> Any:
        if self._store is None:
            base = self._base_store if self._base_store is not None else dist.distributed_c10d._get_default_store()
            try:  # own connection with a short timeout; in-memory stores (HashStore) are shared as they are
                store = base.clone()
                store.set_timeout(datetime.timedelta(seconds=max(self.heartbeat_s, 1.0)))
            except Exception:  # noqa: BLE001 - a store without clone: use it as it is
                store = base
            self._store = store
        return self._store

    def _post(self, *, exited: bool = False) -> None:
        self._n += 1
        value = {"n": self._n, "stage": self.stage, "in": self.in_collective, "step": self.step, "pid": self._pid,
                 "host": self._host, "exited": exited}
        self._get_store().set(self._keys[self.rank], json.dumps(value))

    def beat(self) -> None:
        """Post this rank's beat, read the others', warn about ranks that fell silent or came back."""
        # Silence is judged at the time before the read: a rank paused (SIGSTOP, a stalled VM) between its read and a
        # later clock would judge the others by pre-pause beats and name healthy ranks silent.
        before = self._clock()
        try:
            self._post()
            store = self._get_store()
            if not self._all_posted:  # one request until every rank posted once; multi_get waits for missing keys
                self._all_posted = bool(store.check(self._keys))
                if not self._all_posted:
                    return
            raw = store.multi_get(self._keys)
        except Exception as err:  # noqa: BLE001 - the store host is stopped or gone
            self._store_trouble(err)
            return
        self._store_failing_since = None
        now = self._clock()  # when the beats that changed were seen
        for r, value in enumerate(raw):
            if r == self.rank:
                continue
            got = json.loads(value.decode() if isinstance(value, bytes) else value)
            old = self.beats.get(r)
            if old is None or old.n != got["n"]:
                if r in self.silent and old is not None:
                    self.silent.discard(r)
                    self._say(f"[verl heartbeat] rank {self.rank}: rank {r} answers again "
                              f"after {now - old.seen_at:.0f}s "
                              f"of silence ({Beat(**self._fields(got), seen_at=now).doing()}).")
                self.beats[r] = Beat(**self._fields(got), seen_at=now)
        for r, beat in self.beats.items():
            age = before - beat.seen_at
            if beat.exited or r in self.silent or age <= self.heartbeat_s:
                continue
            self.silent.add(r)
            fails = (f"a collective that needs it fails at devices.timeout_s={self.timeout_s:g}s" if self.timeout_s
                     else "a collective that needs it waits for it")
            self._say(
                f"[verl heartbeat] rank {self.rank}: rank {r} (pid {beat.pid} on {beat.host}) has sent no heartbeat "
                f"for {age:.0f}s (devices.heartbeat_s={self.heartbeat_s:g}); its last beat said it was {beat.doing()}. "
                f"The process is stopped (SIGSTOP, a debugger, swapped out) or hung in code that holds the Python "
                f"GIL; {fails}. Fix: look at rank {r}'s log; on {beat.host} run `py-spy dump --pid {beat.pid}` to see "
                f"where it is (`kill -CONT {beat.pid}` if it was stopped).")

    @staticmethod
    def _fields(got: dict[str, Any]) -> dict[str, Any]:
        return {"n": got["n"], "stage": got["stage"], "in_collective": got["in"], "step": got["step"],
                "pid": got["pid"], "host": got["host"], "exited": got["exited"]}

    def _store_trouble(self, err: Exception) -> None:
        now = self._clock()
        if self._store_failing_since is None:
            self._store_failing_since = now
        if not self._store_warned and now - self._store_failing_since >= self.heartbeat_s and not self._stop.is_set():
            self._store_warned = True
            self._say(f"[verl heartbeat] rank {self.rank}: the rendezvous store has not answered for "
                      f"{now - self._store_failing_since:.0f}s ({type(err).__name__}): the process hosting it (the "
                      "torchrun agent, or rank 0 without one) is stopped or gone. Fix: look at rank 0's log and at the "
                      "launcher.")

    def _say(self, message: str) -> None:
        self.messages.append(message)
        self._log(message)


_current: Heartbeat | None = None


def start_heartbeat(heartbeat_s: float, *, timeout_s: float | None = None, **kwargs: Any) -> Heartbeat | None:
    """Start this process's heartbeat over the default process group's store (0 = off, and one rank: nothing to
    watch). A heartbeat already running is stopped first."""
    global _current
    stop_heartbeat()
    if heartbeat_s <= 0 or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    _current = Heartbeat(heartbeat_s, timeout_s=timeout_s, **kwargs).start()
    return _current


def stop_heartbeat() -> None:
    global _current
    if _current is not None:
        _current.stop()
        _current = None


def current() -> Heartbeat | None:
    return _current


def note(*, stage: str | None = None, in_collective: bool | None = None, step: int | None = None) -> None:
    """Record what this rank is doing in its heartbeat (nothing when none runs)."""
    if _current is not None:
        _current.note(stage=stage, in_collective=in_collective, step=step)


__all__ = ["Beat", "Heartbeat", "current", "note", "start_heartbeat", "stop_heartbeat"]
