"""Built-in reward functions: exact_match, numeric_match (GSM8K style), format."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl.rewards.builtin import exact_match, extract_number, format_reward, numeric_match


@pytest.mark.parametrize(
    ("text", "flexible", "strict"),
    [
        ("The answer is 19.", "19", None),
        ("12-7=5", "5", None),  # the minus between digits is subtraction, not a sign
        ("3-7=-4", "-4", None),
        ("so #### 1,234", "1234", "1234"),
        ("x #### $-3.50 then 7", "-3.50", "-3.50"),  # after #### wins over the last number
        ("cost $1,234.5", "1234.5", None),
        ("1, 2, 3", "3", None),  # a list's commas are not thousands separators
        ("no digits here", None, None),
        ("8 apples #### and no number after the mark", "8", None),  # flexible falls back to the last number
        ("first #### 1 then #### 2", "2", "2"),  # the last marker is the answer
        ("value .5", ".5", None),
    ],
)
def test_extract_number(text: str, flexible: str | None, strict: str | None) -> None:
    want_f = None if flexible is None else Decimal(flexible)
    want_s = None if strict is None else Decimal(strict)
    assert extract_number(text, "flexible") == want_f
    assert extract_number(text, "strict") == want_s


def test_extract_number_rejects_bad_mode() -> None:
    with pytest.raises(ValueError, match="mode must be 'flexible' or 'strict'"):
        extract_number("1", "loose")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("response", "gt", "mode", "want"),
    [
        ("19", "19", "flexible", 1.0),
        ("I think 18", "19", "flexible", 0.0),
        ("3.50", "3.5", "flexible", 1.0),
        ("The total is $1,234.", "1234", "flexible", 1.0),
        ("-4", "-4", "flexible", 1.0),
        ("4", "-4", "flexible", 0.0),
        ("19", "19", "strict", 0.0),  # strict needs the #### marker
        ("work... #### 19", "19", "strict", 1.0),
        (
            "reasoning #### 72",
            "Natalia sold 48/2 = 24 clips... #### 72",
            "strict",
            1.0,
        ),  # GSM8K solution as gt
        ("72", 72, "flexible", 1.0),  # numeric ground truth
        ("0.1", 0.1, "flexible", 1.0),
        ("", "5", "flexible", 0.0),
    ],
)
def test_numeric_match(response: str, gt: object, mode: str, want: float) -> None:
    assert numeric_match("p", response, gt, mode=mode) == want


def test_numeric_match_tolerance_and_metadata_ignored() -> None:
    assert numeric_match("p", "3.14", "3.14159", tolerance=0.01, difficulty="hard") == 1.0
    assert numeric_match("p", "3.0", "3.14159", tolerance=0.01) == 0.0


@pytest.mark.parametrize("gt", [None, "no number", True])
def test_numeric_match_bad_ground_truth_raises(gt: object) -> None:
    with pytest.raises(ValueError, match="ground_truth"):
        numeric_match("p", "1", gt)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=-(10**9), max_value=10**9), dollars=st.booleans(), commas=st.booleans())
def test_numeric_match_reads_any_written_integer(n: int, dollars: bool, commas: bool) -> None:
    body = f"{abs(n):,}" if commas else str(abs(n))
    written = ("-" if n < 0 else "") + ("$" if dollars else "") + body
    assert numeric_match("p", f"Step 1: 2+2. So the answer is {written}.", str(n)) == 1.0
    assert numeric_match("p", f"blah #### {written}", str(n), mode="strict") == 1.0
    assert numeric_match("p", f"So the answer is {written}.", str(n + 1)) == 0.0


def test_exact_match_options() -> None:
    assert exact_match("p", " Paris\n", "Paris") == 1.0
    assert exact_match("p", " Paris\n", "Paris", strip=False) == 0.0
    assert exact_match("p", "paris", "Paris") == 0.0
    assert exact_match("p", "paris", "Paris", case_sensitive=False) == 1.0
    assert exact_match("p", "B", ["A", "B"]) == 1.0  # any accepted answer
    assert exact_match("p", "12", 12) == 1.0
    with pytest.raises(ValueError, match="ground_truth is None"):
        exact_match("p", "x", None)


def test_format_reward_modes_and_flags() -> None:
    text = "<think>a\nb</think><answer>4</answer>"
    assert format_reward("p", text, None, pattern=r"<answer>\d+</answer>") == 1.0
    assert format_reward("p", text, None, pattern=r"<answer>\d+</answer>", match="match") == 0.0
    assert (
        format_reward("p", text, None, pattern=r"<think>.*</think><answer>.*</answer>", match="fullmatch")
        == 0.0
    )
    assert (
        format_reward(
            "p", text, None, pattern=r"<think>.*</think><answer>.*</answer>", match="fullmatch", flags="s"
        )
        == 1.0
    )
    assert format_reward("p", "ANSWER", None, pattern="answer", flags="i") == 1.0
    with pytest.raises(ValueError, match="unknown regex flag 'q'"):
        format_reward("p", "x", None, pattern="x", flags="q")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        format_reward("p", "x", None, pattern="(")
