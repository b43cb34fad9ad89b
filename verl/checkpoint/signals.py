"""Turning SIGTERM/SIGINT into "save at the next step boundary, then exit".

A cluster scheduler sends SIGTERM before it kills a job; dying mid-step throws away everything since the
last save. The trainer's loop checks :attr:`GracefulStop.requested` after each step, saves, and stops.
A second signal of the same kind falls through to the previous handler (Ctrl-C twice still kills).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

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
