"""The threads reward calls run on: a concurrency limit and a per-call timeout.

Reward functions are I/O-bound more often than not (a sandbox subprocess, an HTTP reward server, a judge):
run one after another after generation they idle the whole step. `RewardPool` runs up to `workers` calls
at once, so a batch's calls overlap with each other and, submitted as responses finish, with generation.

A call that runs longer than `timeout_s` (counted from when it starts, not from when it was queued) is
given up: its waiter is told it timed out and the caller scores it 0. Python cannot kill a thread, so the
thread running it is abandoned (a daemon thread: it never holds up the process's exit), left to finish or
hang on its own, and a new worker takes its slot, so the pool keeps `workers` calls running. An abandoned
thread still runs its call, so a function that hangs for good costs a thread each time it is called (and
its result, if it ever comes, is dropped). The pool never retries: a remote function retries on its own
(verl.rewards.remote), within the same timeout.

Threads are started on demand and end after `idle_s` without work, so a pool that is not scoring holds no
threads; a supervisor thread enforces the deadlines while calls come, and ends after an idle wait as well.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from verl.errors import ConfigError


class RewardCall:
    """One submitted call: after `RewardPool.wait`, exactly one of `value`, `error` (what it raised),
    `timed_out` or `crashed` holds its outcome; `crashed` and `replaced` are set only by worker processes
    (verl.rewards.processes)."""

    __slots__ = ("fn", "started", "done", "value", "error", "timed_out", "crashed", "replaced")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.started: float | None = None  # time.monotonic() when a worker began it
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.timed_out = False
        self.crashed: str | None = None  # why the worker process running it died (the sample scores 0)
        self.replaced = False  # its worker outgrew reward.max_rss_mb and was replaced after it (its value counts)


class RewardPool:
    """Up to `workers` reward calls at once, each given up after `timeout_s` seconds (see the module)."""

    def __init__(self, workers: int = 4, timeout_s: float = 60.0, *, idle_s: float = 5.0) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"reward.workers must be an integer >= 1 (reward calls running at once), got "
                              f"{workers!r}.")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"reward.timeout_s must be a number of seconds > 0, got {timeout_s!r}.")
        self.workers, self.timeout_s, self.idle_s = workers, float(timeout_s), idle_s
        self._reset()

    def _reset(self) -> None:
        """No threads, no calls: at start, and in a forked child (which inherits the state, not the threads)."""
        self._pid = os.getpid()
        lock = threading.Lock()
        # One lock, three wake-up lists, so that a state change wakes only the threads it concerns: idle
        # workers (new work), waiters (a call is done), the supervisor (a deadline to keep).
        self._work, self._done, self._watch = (threading.Condition(lock) for _ in range(3))
        self._queue: collections.deque[RewardCall] = collections.deque()
        self._running: set[RewardCall] = set()
        self._alive = 0  # worker threads that count toward `workers` (abandoned ones do not)
        self._idle = 0  # of those, waiting for work
        self._supervised = False  # a supervisor thread is running
        self.abandoned = 0  # threads given up on so far (still running a timed-out call, or finished it)

    def __reduce__(self) -> tuple[Any, ...]:
        """A copy (deepcopy, pickle: an environment copied with its reward manager) is a fresh pool with the
        same settings: threads and calls in flight cannot be copied."""
        return _fresh_pool, (self.workers, self.timeout_s, self.idle_s)

    def submit(self, fns: Sequence[Callable[[], Any]]) -> list[RewardCall]:
        """Queue the calls (in this order); they start as workers free up."""
        calls = [RewardCall(fn) for fn in fns]
        if self._pid != os.getpid():
            self._reset()
        if calls:
            with self._work:
                self._queue.extend(calls)
                self._spawn()
                self._work.notify(len(calls))
        return calls

    def wait(self, call: RewardCall) -> RewardCall:
        """Block until `call` has finished or timed out (at most `timeout_s` after it started)."""
        with self._done:
            self._done.wait_for(lambda: call.done)
        return call

    # -- the threads -------------------------------------------------------------------------------
    def _spawn(self) -> None:
        """Start workers (holding the lock) while there is queued work no idle worker will take."""
        while self._alive < self.workers and len(self._queue) > self._idle:
            self._alive += 1
            threading.Thread(target=self._worker, name="verl-reward-worker", daemon=True).start()

    def _worker(self) -> None:
        while True:
            with self._work:
                if not self._queue:
                    self._idle += 1
                    self._work.wait_for(lambda: self._queue, timeout=self.idle_s)
                    self._idle -= 1
                    if not self._queue:
                        self._alive -= 1
                        return
                call = self._queue.popleft()
                call.started = time.monotonic()
                self._running.add(call)  # its deadline is after every running call's: the supervisor need not know
                if not self._supervised:
                    self._supervised = True
                    threading.Thread(target=self._supervise, name="verl-reward-timeouts", daemon=True).start()
            value, error = None, None
            try:
                value = call.fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, which decides
                error = e
            with self._done:
                if call.timed_out:  # given up on: this thread was replaced, so it ends here
                    return
                self._running.discard(call)
                call.value, call.error, call.done = value, error, True
                self._done.notify_all()

    def _supervise(self) -> None:
        """Time out the calls past their deadline, replacing their threads. It outlives a burst of calls: it
        sleeps until the earliest deadline of the calls running when it looked, then, with none running, for an
        idle wait, and ends only if none runs after that. A thread started per burst (several per RL step, as
        rows finish generating) slowed the generation beside it, and so would waking it when calls end. The
        idle wait is at most `timeout_s`, so it ends before any call started during it is due."""
        with self._watch:
            while True:
                now = time.monotonic()
                overdue = [c for c in self._running if c.started + self.timeout_s <= now]
                for call in overdue:
                    self._running.discard(call)
                    call.timed_out = call.done = True
                    self._alive -= 1
                    self.abandoned += 1
                if overdue:
                    self._spawn()
                    self._work.notify(len(self._queue))
                    self._done.notify_all()
                if self._running:  # until the earliest deadline (calls that end before it are just gone)
                    self._watch.wait(min(c.started for c in self._running) + self.timeout_s - now)
                    continue
                self._watch.wait(min(self.idle_s, self.timeout_s))
                if not self._running:
                    break
            self._supervised = False


def _fresh_pool(workers: int, timeout_s: float, idle_s: float) -> RewardPool:
    return RewardPool(workers, timeout_s, idle_s=idle_s)


__all__ = ["RewardCall", "RewardPool"]
