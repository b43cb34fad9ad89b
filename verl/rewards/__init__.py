"""Rewards: rule-based scorers, user reward functions loaded by path, and the manager that combines them.

The manager's names are imported on first use, so a reward worker process (verl.rewards.processes), which
needs only the functions, does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from verl.rewards.builtin import BUILTIN_REWARDS, exact_match, extract_number, format_reward, numeric_match
from verl.rewards.loader import load_reward_function
from verl.rewards.spec import RewardFunctionSpec

_LAZY = {"RewardManager": "verl.rewards.manager", "RewardResult": "verl.rewards.manager",
         "TrainingProgress": "verl.rewards.manager"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'verl.rewards' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunctionSpec",
    "RewardManager",
    "RewardResult",
    "TrainingProgress",
    "exact_match",
    "extract_number",
    "format_reward",
    "load_reward_function",
    "numeric_match",
]
