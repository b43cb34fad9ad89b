"""Rule-based reward functions that need no user code.

Each takes `(prompt, response, ground_truth, **metadata)` like a user function and returns 1.0 or 0.0, so
the reward manager treats built-ins and user functions the same way. Extra metadata keys are accepted and
ignored, because datasets carry per-row metadata the built-ins do not use. `remote` (a reward server,
`verl.rewards.remote`) is the batched exception; `code_exec` (verl.rewards.code_exec) runs the response's
code against the row's tests in verl.sandbox.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import Any, Literal

from verl.rewards.code_exec import check_code_exec_kwargs, code_exec
from verl.rewards.math_answer import check_math_verify_kwargs, math_verify_reward
from verl.rewards.remote import check_remote_kwargs, remote_reward

# A number as people and GSM8K write it: optional sign or "$", thousands commas, decimals.
# The minus is a sign only when it does not follow a word character or ")", so "12-7" reads as 12 and 7.
_NUMBER_RE = re.compile(
    r"(?:(?<![\w)])(?P<sign>[-\u2212]))?\s?\$?\s?(?P<num>\d(?:[\d,]*\d)?(?:\.\d+)?|\.\d+)"
)
_ANSWER_MARK = "####"


def _to_decimal(match: re.Match[str]) -> Decimal:
    digits = match.group("num").replace(",", "")
    value = Decimal(digits)
    return -value if match.group("sign") else value


def extract_number(text: str, mode: Literal["flexible", "strict"] = "flexible") -> Decimal | None:
    """The answer number in `text`, or None when there is none.

    strict: only the first number after the last `####` (the GSM8K answer marker).
    flexible: that number when a `####` answer is present, else the last number anywhere in the text.
    Returned as Decimal so "3.50" equals "3.5" exactly and "1,234" equals "1234".
    """
    if mode not in ("flexible", "strict"):
        raise ValueError(f"mode must be 'flexible' or 'strict', got {mode!r}")
    mark = text.rfind(_ANSWER_MARK)
    if mark >= 0:
        m = _NUMBER_RE.search(text, mark + len(_ANSWER_MARK))
        if m is not None:
            return _to_decimal(m)
    if mode == "strict":
        return None
    last = None
    for m in _NUMBER_RE.finditer(text):
        last = m
    return _to_decimal(last) if last is not None else None


def _ground_truth_number(ground_truth: Any) -> Decimal:
    if ground_truth is None:
        raise ValueError("ground_truth is None; numeric_match needs a reference answer in every row")
    if isinstance(ground_truth, bool):
        raise ValueError(f"ground_truth is a bool ({ground_truth}); numeric_match needs a number")
    if isinstance(ground_truth, (int, float)):
        try:
            return Decimal(str(ground_truth))
        except InvalidOperation as e:
            raise ValueError(f"ground_truth {ground_truth!r} is not a finite number") from e
    value = extract_number(str(ground_truth), "flexible")
    if value is None:
        raise ValueError(
            f"ground_truth {ground_truth!r} contains no number; numeric_match cannot score it "
            "(use exact_match for non-numeric answers)"
        )
    return value


def needs_ground_truth(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Declare that a reward function cannot score a row without its ground truth.

    The start-up checks read this (`fn.needs_ground_truth`) to report, with file:line, every row that
    lacks one before training starts; a user function may set the same attribute.
    """
    fn.needs_ground_truth = True  # type: ignore[attr-defined]
    return fn


@needs_ground_truth
def numeric_match(
    prompt: Any,
    response: str,
    ground_truth: Any,
    *,
    mode: Literal["flexible", "strict"] = "flexible",
    tolerance: float = 0.0,
    **_metadata: Any,
) -> float:
    """1.0 when the response's answer number equals the ground truth's (GSM8K style).

    The ground truth may be a number, "72" or a full GSM8K solution ending in "#### 72". `tolerance` is an
    absolute tolerance for answers that are floats; the default 0 compares exactly.
    """
    expected = _ground_truth_number(ground_truth)
    got = extract_number(response, mode)
    if got is None:
        return 0.0
    if tolerance > 0:
        return 1.0 if abs(got - expected) <= Decimal(str(tolerance)) else 0.0
    return 1.0 if got == expected else 0.0


def _numeric_answer(response: str, *, mode: Literal["flexible", "strict"] = "flexible", **_kwargs: Any) -> str | None:
    """The number numeric_match reads in `response`, written canonically ("3.50" and "3.5" agree)."""
    got = extract_number(response, mode)
    return None if got is None else format(got.normalize(), "f")


# What maj@k votes on (`RewardManager.extracted_answers`): the answer this function compares, not the text.
numeric_match.extract_answer = _numeric_answer  # type: ignore[attr-defined]


@needs_ground_truth
def exact_match(
    prompt: Any,
    response: str,
    ground_truth: Any,
    *,
    strip: bool = True,
    case_sensitive: bool = True,
    **_metadata: Any,
) -> float:
    """1.0 when the response equals the ground truth (or any of a list of accepted answers)."""
    if ground_truth is None:
        raise ValueError("ground_truth is None; exact_match needs a reference answer in every row")
    accepted = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]

    def norm(s: Any) -> str:
        s = str(s)
        if strip:
            s = s.strip()
        return s if case_sensitive else s.casefold()

    got = norm(response)
    return 1.0 if any(got == norm(a) for a in accepted) else 0.0


def _exact_answer(response: str, *, strip: bool = True, case_sensitive: bool = True, **_kwargs: Any) -> str:
    """The response as exact_match compares it."""
    response = response.strip() if strip else response
    return response if case_sensitive else response.casefold()


exact_match.extract_answer = _exact_answer  # type: ignore[attr-defined]


_FLAG_LETTERS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


@lru_cache(maxsize=256)
def compile_format_pattern(pattern: str, flags: str = "") -> re.Pattern[str]:
    """Compile once per (pattern, flags); raises ValueError naming the bad flag or regex."""
    bits = 0
    for letter in flags:
        if letter not in _FLAG_LETTERS:
            raise ValueError(f"unknown regex flag {letter!r} in flags={flags!r}; use any of 'imsx'")
        bits |= _FLAG_LETTERS[letter]
    try:
        return re.compile(pattern, bits)
    except re.error as e:
        raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {e}") from e


def format_reward(
    prompt: Any,
    response: str,
    ground_truth: Any,
    *,
    pattern: str,
    match: Literal["search", "fullmatch", "match"] = "search",
    flags: str = "",
    **_metadata: Any,
) -> float:
    """1.0 when the response has the required shape (e.g. `<think>.*</think>`); ignores the ground truth.

    `match` picks re.search (anywhere), re.match (at the start) or re.fullmatch (the whole response);
    `flags` is a string of regex flag letters, e.g. "s" so "." also matches newlines.
    """
    if match not in ("search", "fullmatch", "match"):
        raise ValueError(f"match must be 'search', 'fullmatch' or 'match', got {match!r}")
    regex = compile_format_pattern(pattern, flags)
    return 1.0 if getattr(regex, match)(response) is not None else 0.0


def _check_format_kwargs(kwargs: dict[str, Any]) -> None:
    pattern = kwargs.get("pattern")
    if not isinstance(pattern, str):
        raise ValueError(
            "the format reward needs kwargs.pattern, a regular expression string, "
            "e.g. kwargs: {pattern: '<answer>.*</answer>'}"
        )
    compile_format_pattern(pattern, kwargs.get("flags", ""))
    if kwargs.get("match", "search") not in ("search", "fullmatch", "match"):
        raise ValueError(f"kwargs.match must be 'search', 'fullmatch' or 'match', got {kwargs['match']!r}")


def _check_numeric_kwargs(kwargs: dict[str, Any]) -> None:
    if kwargs.get("mode", "flexible") not in ("flexible", "strict"):
        raise ValueError(f"kwargs.mode must be 'flexible' or 'strict', got {kwargs['mode']!r}")
    tol = kwargs.get("tolerance", 0.0)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"kwargs.tolerance must be a number >= 0, got {tol!r}")


BUILTIN_REWARDS: dict[str, Callable[..., Any]] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "math_verify": math_verify_reward,
    "format": format_reward,
    "remote": remote_reward,
    "code_exec": code_exec,
}
# Built-ins that score a whole batch per call (one HTTP request per batch, not per sample).
BATCHED_BUILTINS = frozenset({"remote"})

# Checks of a built-in's kwargs that run when the reward manager is built, so a bad regex fails at start-up.
BUILTIN_KWARG_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "numeric_match": _check_numeric_kwargs,
    "format": _check_format_kwargs,
    "math_verify": check_math_verify_kwargs,
    "remote": check_remote_kwargs,
    "code_exec": check_code_exec_kwargs,
}

__all__ = [
    "BATCHED_BUILTINS",
    "BUILTIN_REWARDS",
    "compile_format_pattern",
    "exact_match",
    "extract_number",
    "format_reward",
    "needs_ground_truth",
    "numeric_match",
]
