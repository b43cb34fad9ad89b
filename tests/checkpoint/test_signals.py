"""GracefulStop: the first SIGTERM/SIGINT becomes a flag for the loop; handlers are restored on exit."""

from __future__ import annotations

import os
import signal

import pytest

from verl.checkpoint import GracefulStop


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_sets_flag_and_loop_stops_at_boundary(sig):
    before = signal.getsignal(sig)
    steps_done = []
    with GracefulStop() as stop:
        for step in range(1, 100):
            steps_done.append(step)
            if step == 3:
                os.kill(os.getpid(), sig)  # delivered to the main thread before the next bytecode
            if stop.requested:
                break
    assert steps_done == [1, 2, 3] and stop.received == sig
    assert signal.getsignal(sig) is before


def test_second_signal_falls_through_to_previous_handler():
    seen = []

    def previous(signum, frame):
        seen.append(signum)

    old = signal.signal(signal.SIGTERM, previous)
    try:
        with GracefulStop() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested and seen == []
            os.kill(os.getpid(), signal.SIGTERM)
            assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)
