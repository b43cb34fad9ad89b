"""A reward that depends only on the prompt: each held-out row has its own score, so a validation that
missed or doubled a row (or did not reduce over ranks) would report another mean."""

from typing import Any


def prompt_digits_reward(prompt: Any, response: str, ground_truth: Any, **meta: Any) -> float:
    return (sum(int(c) for c in str(prompt) if c.isdigit()) % 7 + 1) / 7


def response_chars_reward(prompt: Any, response: str, ground_truth: Any, **meta: Any) -> float:
    """Differs between the samples of a prompt (non-zero GRPO advantages) and is the same on any rank."""
    return sum(map(ord, response)) % 7 / 6
