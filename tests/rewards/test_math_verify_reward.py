"""`math_verify`: MATH-style answers compared for mathematical equality (Hugging Face's Math-Verify)."""

from __future__ import annotations

import builtins
import sys

import pytest

from verl.errors import RewardError
from verl.rewards import RewardManager

pytest.importorskip("math_verify")

from verl.rewards.math_answer import _parsed_ground_truth, math_verify_reward  # noqa: E402


@pytest.mark.parametrize(
    ("response", "ground_truth", "want"),
    [
        ("So the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", 1.0),
        ("So the answer is \\boxed{0.5}.", "\\frac{1}{2}", 1.0),  # equal value, written differently
        ("The answer is \\boxed{\\sqrt 2}", "\\sqrt{2}", 1.0),
        ("\\boxed{1+x^2}", "x^2+1", 1.0),
        ("we get \\boxed{\\pi/4}", "$\\frac{\\pi}{4}$", 1.0),  # ground truth in $...$ too
        ("so \\boxed{(1, 2)}", "(1,2)", 1.0),
        ("48 + 24 = 72, so she sold 72 clips.", 72, 1.0),  # a number ground truth; no box: the last answer
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
        ("the answer is 4, not 3", "3", 0.0),
        ("I do not know.", "3", 0.0),  # nothing to read: 0, not an error
    ],
)
def test_math_verify_reward(response: str, ground_truth: object, want: float) -> None:
    assert math_verify_reward("q", response, ground_truth) == want


def test_a_ground_truth_without_an_answer_stops_the_run_with_its_text() -> None:
    with pytest.raises(RewardError, match=r"ground truth '' has no answer Math-Verify can read"):
        math_verify_reward("q", "\\boxed{1}", "   ")


def test_the_ground_truth_is_parsed_once_per_group() -> None:
    _parsed_ground_truth.cache_clear()
    for response in ("\\boxed{2}", "\\boxed{3}", "\\boxed{2}"):
        math_verify_reward("q", response, "2")
    info = _parsed_ground_truth.cache_info()
    assert (info.misses, info.hits) == (1, 2)


def test_as_a_builtin_with_options_checked_at_start_up() -> None:
    mgr = RewardManager([{"name": "math_verify", "kwargs": {"float_rounding": 2}}])
    result = mgr.score(["q", "q"], ["\\boxed{3.14159}", "\\boxed{2}"], ["3.14", "3"])
    assert result.scores.tolist() == [1.0, 0.0]  # equal after rounding to 2 digits
    with pytest.raises(RewardError, match=r"reward.functions\[0\] .*math_verify takes kwargs .* not \['tolerance'\]"):
        RewardManager([{"name": "math_verify", "kwargs": {"tolerance": 0.1}}])
    with pytest.raises(RewardError, match="kwargs.float_rounding must be a positive int"):
        RewardManager([{"name": "math_verify", "kwargs": {"float_rounding": 0}}])


def test_without_the_library_the_reward_fails_at_start_up_with_the_install_command(monkeypatch) -> None:
    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name == "math_verify":
            raise ImportError("No module named 'math_verify'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "math_verify")
    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    with pytest.raises(RewardError, match=r"reward.functions\[0\] .*Math-Verify library.*pip install math-verify"):
        RewardManager([{"name": "math_verify"}])
