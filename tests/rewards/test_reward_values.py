"""Reward values a run cannot train on: an int past a float's range, NaN/inf, and what a bool means (0/1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl.errors import RewardError
from verl.rewards import RewardManager

CODE = """
def huge(prompt, response, ground_truth, **kw):
    return 10 ** 400

def huge_negative_in_dict(prompt, response, ground_truth, **kw):
    return {"score": -10 ** 400}

def huge_extra(prompt, response, ground_truth, **kw):
    return {"score": 1.0, "big": 10 ** 400}

def numpy_inf(prompt, response, ground_truth, **kw):
    import numpy as np
    return np.float32("inf") if response == "b" else 0.0

def exact(prompt, response, ground_truth, **kw):
    return response == ground_truth
"""


@pytest.fixture()
def manager(tmp_path: Path):
    (tmp_path / "r.py").write_text(CODE)
    return lambda fn: RewardManager([{"name": f"r.py:{fn}"}], base_dir=tmp_path)


@pytest.mark.parametrize(("fn", "pattern"), [
    ("huge", r"'huge'.*on sample 0.*returned 1000000.*must be finite \(an integer larger than a float holds\)"),
    ("huge_negative_in_dict", r"'huge_negative_in_dict'.*on sample 0.*returned -1000.*larger than a float holds"),
    ("numpy_inf",
     r"'numpy_inf'.*on sample 1 \(data_source=None\).*returned (np.float32\()?inf.*must be finite \(not NaN/inf\)"),
])
def test_a_reward_out_of_a_floats_range_is_a_reward_error_naming_function_and_sample(manager, fn, pattern) -> None:
    with pytest.raises(RewardError, match=pattern):
        manager(fn).score(["p", "p"], ["a", "b"], ["a", "a"])


def test_an_extra_past_a_floats_range_is_kept_with_the_sample_not_a_traceback(manager) -> None:
    result = manager("huge_extra").score(["p"], ["a"], ["a"])
    assert result.scores.tolist() == [1.0]


def test_a_bool_reward_is_documented_as_0_or_1(manager) -> None:
    result = manager("exact").score(["p", "p"], ["a", "b"], ["a", "a"])
    assert result.scores.tolist() == [1.0, 0.0]
    docs = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    assert "True/False count as 1/0" in docs
