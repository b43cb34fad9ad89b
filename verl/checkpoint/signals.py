"""Turning SIGTERM/SIGINT into "save at the next step boundary, then exit".

A cluster scheduler sends SIGTERM before it kills a job; dying mid-step throws away everything since the
last save. The trainer's loop checks :attr:`GracefulStop.requested` after each step, saves, and stops.
A second signal of the same kind falls through to the previous handler (Ctrl-C twice still kills).

With several ranks the signal reaches them at different times (or only one of them): a rank that stops
alone walks into the checkpoint's collectives while the others walk into the next step's, and every rank
waits forever. So the loop asks :meth:`GracefulStop.agree` once per step, which takes the maximum over all
ranks: every rank stops after the same step and saves the same checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class TrainingInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT/SIGTERM after saving a checkpoint at a step boundary.

    A `KeyboardInterrupt` (what Ctrl-C raises anyway), so code that does not know it still stops; `verl train`
    turns it into the exit status a shell expects (128 + signal: 130 for Ctrl-C, 143 for SIGTERM).
    """

    def __init__(self, signum: int, step: int, total: int, checkpoint: str | None = None) -> None:
        self.signum, self.step, self.total, self.checkpoint = signum, step, total, checkpoint
        saved = f"; saved {checkpoint}" if checkpoint else ""
        super().__init__(f"interrupted at step {step}/{total} ({signal.Signals(signum).name}){saved}; "
                         "rerun the same command to resume")

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)


class GracefulStop:
    """Context manager that records SIGTERM/SIGINT instead of dying on the first one.

    >>> with GracefulStop() as stop:
    ...     for step in range(n):
    ...         train_step()
    ...         if stop.requested:
    ...             manager.save(step, ...); break
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        self._installed = False

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived."""
        return self.received is not None

    def agree(self, device: torch.device | None = None) -> bool:
        """Whether any rank received a stop signal: one all-reduce (MAX) on the default group, which every
        rank must call at the same point. A rank that got none takes on the signal another rank got, so
        all of them save, stop and exit alike. `device` is where the default group's backend reduces
        (this rank's GPU under NCCL); one process needs no collective."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([self.received or 0], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            got = int(flag.item())
            if got and self.received is None:
                self.received = got
                logger.warning("another rank received %s: saving a checkpoint and stopping after this step "
                               "on every rank", signal.Signals(got).name)
        return self.received is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            # second signal: behave as if we were not here
            prev = self._previous.get(signum)
            self._restore()
            if callable(prev):
                prev(signum, frame)
            elif prev == signal.SIG_DFL:
                signal.raise_signal(signum)
            return
        self.received = signum
        logger.warning(
            "received %s: will save a checkpoint and stop at the end of this step "
            "(send it again to stop immediately)",
            signal.Signals(signum).name,
        )

    def __enter__(self) -> GracefulStop:
        # signal handlers can only be set from the main thread; elsewhere we stay a passive flag
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.getsignal(s)
                signal.signal(s, self._handle)
            self._installed = True
        return self

    def _restore(self) -> None:
        if self._installed:
            for s, prev in self._previous.items():
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
            self._installed = False

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._restore()
