"""Rewards: rule-based scorers, user reward functions loaded by path, and the manager that combines them."""

from verl.rewards.builtin import BUILTIN_REWARDS, exact_match, extract_number, format_reward, numeric_match
from verl.rewards.loader import load_reward_function
from verl.rewards.manager import RewardManager, RewardResult, TrainingProgress
from verl.rewards.spec import RewardFunctionSpec

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
