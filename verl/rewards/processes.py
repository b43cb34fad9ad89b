"""Per-sample reward calls in worker processes (`reward.executor: process`).

Why not threads: a reward thread in the trainer's process takes the GIL each time it wakes (a call
starts, a sandbox run or an HTTP reply returns, a call ends), and each such hand-off slows the thread that
is generating beside it (benchmarks/reward_overlap.py measures it); a CPU-bound Python reward (answer
parsing, math verification) holds the GIL outright, so on threads it runs neither beside generation nor
beside other calls. In worker processes neither happens, and nothing in the trainer's process wakes while
it generates: it writes a call to an idle worker's pipe when the call is submitted, and reads the results
when it next submits or waits. A call queued while every worker is busy starts at that next look.

A call running longer than `timeout_s` (from when its worker began it) is ended for good: its worker, and
what it started in its process group, is killed and a new one takes its place (a thread could only be
abandoned). A worker that dies in the middle of a call (os._exit, a signal, the OOM killer, a crash in C
code) fails only that call: it is marked `crashed`, with the exit code or signal, and a new worker takes the
dead one's place; the manager scores the sample 0 and stops the run only past `reward.max_worker_crashes` in
one step, since a function that crashes on every sample would otherwise train on zeros. A worker whose
resident memory exceeds `max_rss_mb` after a call (a reward that leaks) is replaced once that call's result
is read, so a leak cannot grow the run without bound; the call's result counts.

Workers are plain `python -m verl.rewards.processes` processes (no fork of the trainer, so no copy of its
threads, CUDA context or memory; no `if __name__ == "__main__"` needed in the user's script), sharing the
trainer's sys.path, started by `RewardManager.configure` (they load while the model does), ending when the
trainer does (even mid-call) and killed when the pool is collected. They get the per-sample functions once:
a function named in the spec (a built-in, a file or a module) is loaded again by that name; a Python callable
is pickled, so it must be importable (defined at a module's top level, not in `__main__`, not a lambda);
`RewardManager` refuses others at start-up. The sandbox settings (`sandbox.python`, `sandbox.require`) go
with them. Messages are pickled between these processes, never read from a file.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any

from verl.errors import ConfigError, RewardError
from verl.rewards.functions import LoadedFunction, call_one, loaded_function
from verl.rewards.loader import load_reward_function
from verl.rewards.pool import RewardCall
from verl.sandbox.isolation import DEFAULTS as SANDBOX_DEFAULTS

STARTUP_S = 120.0  # a worker that has not loaded its functions by then is given up


def recipe(ld: LoadedFunction, base_dir: str | None) -> tuple[Any, ...]:
    """How a worker gets `ld`: `(spec, label, where, base_dir, callable or None)`; a function the spec named
    is loaded again by that name, a Python callable is pickled (refused here when it cannot be)."""
    if ld.named:
        return (ld.spec, ld.label, ld.where, base_dir, None)
    module = getattr(ld.fn, "__module__", None) or getattr(type(ld.fn), "__module__", None)
    fix = ("define it at the top level of a module and pass it from there (or name it in reward.functions as "
           "'file.py:fn'), or set reward.executor=thread")
    if module == "__main__":
        raise ConfigError(f"{ld.where}: reward.executor=process runs reward functions in worker processes, which "
                          f"cannot import the running script's own functions (__main__): {fix}.")
    try:
        pickle.dumps(ld.fn)
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same here
        raise ConfigError(f"{ld.where}: reward.executor=process sends reward functions to worker processes by "
                          f"pickling, and this one cannot be pickled ({type(e).__name__}: {e}): {fix}.") from None
    return (ld.spec, ld.label, ld.where, None, ld.fn)


def _rebuild(entry: tuple[Any, ...] | None) -> LoadedFunction | None:
    if entry is None:  # a batched or TRL-style function: it runs in the trainer's process
        return None
    spec, label, where, base_dir, fn = entry
    named = fn is None
    if named:
        fn = load_reward_function(spec.name, base_dir=base_dir, where=where)
    return loaded_function(spec, fn, label, where, named=named)


def _exit_status(code: int | None) -> str:
    """`exit code 3`, `signal 9, SIGKILL`: how a worker process ended, as Popen reports it."""
    if code is None:
        return "exit status unknown"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"signal {-code}, {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"


def _rss_mb() -> float | None:
    """This process's resident memory in MiB, from /proc (None where there is none: not Linux)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


class _Worker:
    __slots__ = ("process", "conn", "call", "sent", "ready")

    def __init__(self, process: subprocess.Popen, conn: Connection) -> None:
        self.process, self.conn = process, conn
        self.call: RewardCall | None = None
        self.sent = 0.0  # when `call` was written to it
        self.ready: float | None = None  # when it said its functions were loaded

    @property
    def started(self) -> float | None:
        """When the worker began its call: on a ready worker, when it was sent."""
        return None if self.ready is None else max(self.sent, self.ready)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # with what the call started in its group
        except (ProcessLookupError, PermissionError):
            pass
        self.conn.close()
        self.process.wait()


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()


class ProcessRewardPool:
    """Up to `workers` worker processes running per-sample reward calls (see the module docstring); the
    calls are `(function index, arguments of call_one after the function)`. `max_rss_mb` (0: no limit) is
    the resident memory past which a worker is replaced after its call."""

    def __init__(self, recipes: Sequence[tuple[Any, ...]], workers: int = 4, timeout_s: float = 60.0,
                 max_rss_mb: float = 0) -> None:
        self.recipes, self.workers, self.timeout_s = list(recipes), workers, float(timeout_s)
        self.max_rss_mb = max_rss_mb
        self._reset()

    def _reset(self) -> None:
        """No workers: at start, and in a forked child (whose copies of the parent's workers are not its own)."""
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer.detach()
        self._pid = os.getpid()
        self._lock = threading.RLock()  # the trainer's thread and, rarely, another scoring thread
        self._workers: list[_Worker] = []
        self._queue: deque[RewardCall] = deque()
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    def _in_this_process(self) -> None:
        if self._pid != os.getpid():  # a forked child starts workers of its own
            self._reset()

    def __reduce__(self) -> tuple[Any, ...]:
        return ProcessRewardPool, (self.recipes, self.workers, self.timeout_s, self.max_rss_mb)

    def submit(self, jobs: Sequence[tuple[int, tuple[Any, ...]]]) -> list[RewardCall]:
        """Queue the calls; those an idle (or new) worker can take start now."""
        self._in_this_process()
        calls = [RewardCall(job) for job in jobs]
        with self._lock:
            self._queue.extend(calls)
            self._look(0)
        return calls

    def wait(self, call: RewardCall) -> RewardCall:
        """Block until `call` has finished, failed or timed out."""
        with self._lock:
            while not call.done:
                self._look(self._until_next_deadline())
        return call

    def start(self) -> None:
        """Start every worker now, without waiting: they load their functions while the trainer sets up."""
        self._in_this_process()
        with self._lock:
            while len(self._workers) < self.workers:
                self._start()

    def close(self) -> None:
        """Kill the workers (a later call starts new ones)."""
        with self._lock:
            _kill_all(self._workers)
            self._workers.clear()

    # -- the trainer's side of the pipes -----------------------------------------------------------
    def _look(self, timeout: float | None) -> None:
        """Read what the workers said (waiting up to `timeout` for the first word; an idle one says only that
        it died), end overdue calls, hand queued calls to idle workers."""
        workers = {w.conn: w for w in self._workers}
        for conn in wait(list(workers), timeout) if workers else ():
            self._read(workers[conn])
        now = time.monotonic()
        for w in list(self._workers):
            if w.call is not None and w.started is not None and now >= w.started + self.timeout_s:
                w.call.timed_out = w.call.done = True
                self._replace(w)
            elif w.ready is None and now >= w.sent + STARTUP_S:
                self._fail(w, f"did not start within {STARTUP_S:g} s")
        for w in list(self._workers):
            if w.call is None and self._queue:
                self._send(w, self._queue.popleft())
        while self._queue and len(self._workers) < self.workers:
            self._send(self._start(), self._queue.popleft())

    def _until_next_deadline(self) -> float | None:
        deadlines = [w.started + self.timeout_s for w in self._workers if w.call is not None and w.started is not None]
        deadlines += [w.sent + STARTUP_S for w in self._workers if w.ready is None]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _read(self, w: _Worker) -> None:
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            try:  # its end of the pipe closed: it is exiting
                code = w.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            if w.call is not None:  # only its call fails; an idle worker's death costs nothing
                w.call.crashed = (f"reward worker died ({_exit_status(code)}) while "
                                  f"{'scoring this sample' if w.ready is not None else 'loading the reward functions'}")
                w.call.done = True
            self._replace(w)
            return
        if message[0] == "ready":
            w.ready = time.monotonic()
            return
        _, value, error, rss_mb = message
        call, w.call = w.call, None
        if call is not None:
            call.value, call.error, call.done = value, error, True
        if self.max_rss_mb and rss_mb is not None and rss_mb > self.max_rss_mb:  # a leak: start afresh
            if call is not None:
                call.replaced = True
            self._replace(w)

    def _fail(self, w: _Worker, what: str) -> None:
        """A worker that never started: its call fails with what happened (every worker would do the same)."""
        if w.call is not None:
            f, args = w.call.fn
            w.call.error = RewardError(
                f"the reward worker process running '{self.recipes[f][1]}' on sample {args[0]} {what}. "
                "reward.executor=process: check that the machine is not overloaded and that the reward functions "
                "load quickly (or run them with reward.executor=thread).")
            w.call.done = True
        self._replace(w)

    def _replace(self, w: _Worker) -> None:
        w.call = None
        w.kill()
        self._workers.remove(w)

    def _start(self) -> _Worker:
        ours, theirs = Pipe(duplex=True)
        process = subprocess.Popen(
            [sys.executable, "-m", "verl.rewards.processes", str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            start_new_session=True, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})  # where verl itself is
        theirs.close()
        worker = _Worker(process, ours)
        worker.sent = time.monotonic()
        ours.send((list(sys.path), dict(SANDBOX_DEFAULTS), self.recipes))  # sandbox.python, sandbox.require
        self._workers.append(worker)
        return worker

    def _send(self, w: _Worker, call: RewardCall) -> None:
        w.call, w.sent = call, time.monotonic()
        try:
            w.conn.send(call.fn)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            w.call = None
            f, args = call.fn
            call.error = RewardError(
                f"sample {args[0]} cannot be sent to a reward worker process (reward.executor=process): its prompt, "
                f"ground truth or metadata do not pickle ({type(e).__name__}: {e}); use plain data in the rows, "
                "or reward.executor=thread.")
            call.done = True
        except OSError:  # it died since it was last looked at: the call waits for the next worker
            self._queue.appendleft(call)
            self._replace(w)


def _end_with(trainer: int) -> None:
    """End this worker once the trainer is gone, even in the middle of a call (a closed pipe is only
    noticed between calls)."""
    while os.getppid() == trainer:
        time.sleep(1.0)
    os._exit(0)


def serve(conn: Connection, trainer: int) -> None:
    """A worker: load the functions, then answer `(f, args)` with `("done", value, error, resident MiB)`
    until the pipe closes."""
    threading.Thread(target=_end_with, args=(trainer,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    path, sandbox, recipes = conn.recv()
    sys.path[:] = path
    SANDBOX_DEFAULTS.update(sandbox)  # code_exec's runs as the trainer's would
    try:
        functions: list[LoadedFunction | None] | None = [_rebuild(entry) for entry in recipes]
        failure = None
    except Exception as e:  # noqa: BLE001 - every call gets this error
        functions, failure = None, RewardError(f"a reward worker process could not load the reward functions: "
                                               f"{type(e).__name__}: {e}")
    conn.send(("ready",))
    while True:
        try:
            f, args = conn.recv()
        except (EOFError, OSError):
            return
        value, error = None, failure
        if functions is not None:
            try:
                value = call_one(functions[f], *args)
            except RewardError as e:
                error = RewardError(str(e))  # its message names the user's line; the traceback stays here
            except BaseException as e:  # noqa: BLE001 - SystemExit and the like from user code
                error = RewardError(f"reward function '{functions[f].label}' raised {type(e).__name__}: {e} "
                                    f"on sample {args[0]}.")
        try:
            conn.send(("done", value, error, _rss_mb()))
        except Exception as e:  # noqa: BLE001 - a return value that does not pickle
            conn.send(("done", None, RewardError(
                f"reward function '{functions[f].label}' returned a {type(value).__name__}, which cannot be sent "
                f"back from its worker process ({type(e).__name__}: {e}); return a number or a dict of plain "
                "values."), _rss_mb()))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), int(sys.argv[2]))


__all__ = ["ProcessRewardPool", "recipe", "serve"]
