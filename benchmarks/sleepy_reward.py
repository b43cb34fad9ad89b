"""The reward of benchmarks/reward_overlap.py, in a module of its own so that reward worker processes
(`reward.executor=process`) can import it: the digits fraction of the response, after waiting (as a
sandbox run or a remote call waits) for the number of seconds written in `delay_file`, which the benchmark
recalibrates as it runs (a file, so that every worker process reads the current value)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


class SleepyReward:
    __name__ = "sleepy_digits"

    def __init__(self, delay_file: str | Path) -> None:
        self.delay_file = str(delay_file)
        self.delay = 0.0

    @property
    def delay(self) -> float:
        return float(Path(self.delay_file).read_text())

    @delay.setter
    def delay(self, seconds: float) -> None:
        Path(self.delay_file).write_text(repr(float(seconds)))

    def __call__(self, prompt: Any, response: str, ground_truth: Any, **meta: Any) -> float:
        time.sleep(self.delay)
        return sum(c.isdigit() for c in response) / max(len(response), 1)
