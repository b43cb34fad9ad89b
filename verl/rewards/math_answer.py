"""`math_verify`: 1.0 when the response's final answer is mathematically equal to the ground truth.

For MATH-style data (answers such as ``\\frac{1}{2}``, ``\\sqrt{2}``, ``x^2+1``, ``(1,2)``), where a string or
number match fails on equal answers written differently. Parsing and the equivalence check are Hugging
Face's Math-Verify library (``pip install math-verify``), as TRL's accuracy reward uses it: the response's
answer is the last ``\\boxed{...}`` or, without one, the last expression Math-Verify finds; the ground
truth may be bare LaTeX (``\\frac{\\pi}{4}``, as verl's MATH preprocessing stores it), ``$...$`` or a
number. A ground truth Math-Verify cannot read stops the run with its text: a silent 0 would train on it.

The library is optional: asking for the reward without it fails when the reward functions are built, with
the install command.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from verl.errors import RewardError, install_hint

INSTALL_HINT = install_hint("math-verify", "math")
_VERIFY_KWARGS = ("float_rounding", "numeric_precision", "strict")


_MISSING = f"the math_verify reward needs the Math-Verify library, which is not installed. Fix: {INSTALL_HINT}"


def _library() -> Any:
    try:
        import math_verify
    except ImportError:
        raise RewardError(_MISSING) from None
    return math_verify


def _own_timeout() -> int | None:
    """Math-Verify's own 5 s timeout is a SIGALRM, which only the main thread may set: on a reward worker
    thread (verl.rewards.pool) it is off, and reward.timeout_s bounds the whole call instead."""
    return 5 if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)  # a GRPO group's n responses share one ground truth
def _parsed_ground_truth(text: str) -> Any:
    parse = _library().parse
    parsed = parse(text, parsing_timeout=_own_timeout()) or parse(f"${text}$", parsing_timeout=_own_timeout())
    if not parsed:
        raise RewardError(f"math_verify: the ground truth {text!r} has no answer Math-Verify can read. Fix: store "
                          "the final answer (LaTeX such as \\frac{1}{2}, or a number) in the ground truth, or "
                          "score these rows with another reward function.")
    return parsed


def math_verify_reward(prompt: Any, response: str, ground_truth: Any, *, float_rounding: int = 6,
                       numeric_precision: int = 15, strict: bool = True, **_metadata: Any) -> float:
    """1.0 when Math-Verify finds the response's answer equal to the ground truth, else 0.0.

    `float_rounding`, `numeric_precision` and `strict` are Math-Verify's `verify` options (digits compared
    after rounding, digits of numeric evaluation, and whether symbols must match exactly)."""
    gold = _parsed_ground_truth(str(ground_truth).strip())
    answer = _library().parse(response, parsing_timeout=_own_timeout())
    if not answer:
        return 0.0
    return 1.0 if _library().verify(gold, answer, float_rounding=float_rounding,
                                   numeric_precision=numeric_precision, strict=strict,
                                   timeout_seconds=_own_timeout()) else 0.0


math_verify_reward.needs_ground_truth = True  # type: ignore[attr-defined]  # (builtin.needs_ground_truth's mark)


def check_math_verify_kwargs(kwargs: dict[str, Any]) -> None:
    """At start-up: the library is installed and the options are ones `verify` takes."""
    try:
        _library()
    except RewardError:
        raise ValueError(_MISSING) from None
    unknown = sorted(set(kwargs) - set(_VERIFY_KWARGS))
    if unknown:
        raise ValueError(f"math_verify takes kwargs {list(_VERIFY_KWARGS)}, not {unknown}")
    for key in ("float_rounding", "numeric_precision"):
        value = kwargs.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"kwargs.{key} must be a positive int, got {value!r}")
    if not isinstance(kwargs.get("strict", True), bool):
        raise ValueError(f"kwargs.strict must be true or false, got {kwargs['strict']!r}")


__all__ = ["INSTALL_HINT", "check_math_verify_kwargs", "math_verify_reward"]
