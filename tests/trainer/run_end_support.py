"""A reward function for tests/trainer/test_run_end.py: digits, or a ValueError once VERL_TEST_REWARD_RAISE is
set (the test sets it when the step it wants to fail starts)."""

from __future__ import annotations

import os
from typing import Any


def flaky_reward(prompt: Any, response: str, ground_truth: Any, **meta: Any) -> float:
    if os.environ.get("VERL_TEST_REWARD_RAISE"):
        raise ValueError("the reward service is down")
    return sum(c.isdigit() for c in response) / max(len(response), 1)
