"""The `code_exec` reward and the `python` tool: tests in each layout code datasets use, partial credit,
hostile responses scored 0 with their reason (the sample's record), and bad options refused at start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl.data.tool_parsers import ToolCall
from verl.env.tools import check_tools, python_tool, run_tool
from verl.errors import RewardError
from verl.rewards import code_exec as code_exec_module
from verl.rewards.code_exec import cases_of, code_exec, extract_code
from verl.rewards.manager import RewardManager

ADD = "def add(a, b):\n    return a + b"


def test_extract_code_takes_the_last_fenced_block_or_the_whole_text():
    text = "First try:\n```python\nprint(1)\n```\nBetter:\n```\nprint(2)\n```\nDone."
    assert extract_code(text) == "print(2)\n"
    assert extract_code("  print(3)  ") == "print(3)"
    assert extract_code("no block here", "fenced") is None
    assert extract_code(text, "all") == text.strip()


def test_stdin_stdout_pairs_give_partial_credit_and_ignore_trailing_whitespace():
    code = "```python\na, b = map(int, input().split())\nprint(a + b if a < 5 else a - b)\n```"
    tests = {"inputs": ["1 2\n", "3 4", "9 1"], "outputs": ["3", "7  \n\n", "10"]}
    out = code_exec(None, code, tests)
    assert (out["score"], out["acc"], out["passed"], out["tests"]) == (pytest.approx(2 / 3), 0.0, 2, 3)
    assert out["status"] == "wrong_answer" and out["reason"] == "test 3 of 3: printed '8', expected '10'"


def test_assert_tests_with_setup_and_a_json_ground_truth():
    tests = json.dumps({"asserts": ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert sqrt(4) == 2"],
                        "setup": "from math import sqrt"})
    out = code_exec(None, ADD, tests)
    assert (out["passed"], out["tests"], out["status"]) == (2, 3, "wrong_answer")
    assert out["reason"] == "test 2 of 3: assert add(2, 2) == 5 is false (add(2, 2) = 4)"
    assert code_exec(None, ADD, ["assert add(1, 2) == 3"])["acc"] == 1.0


def test_an_expected_output_and_a_program_template():
    assert code_exec(None, "6*7", 42, program="print({code})")["score"] == 1.0
    out = code_exec(None, "6*", "42", program="print({code})")
    assert out["score"] == 0.0 and out["status"] == "error" and "SyntaxError" in out["reason"]


def test_bad_tests_raise_so_the_row_is_named():
    with pytest.raises(ValueError, match="same, non-zero length"):
        cases_of("", {"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="cannot read tests"):
        cases_of("", {"something": 1})


HOSTILE = {
    "infinite loop": "while True:\n    pass",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "memory hog": "x = bytearray(10**10)",
    "huge output": "while True:\n    print('x' * 10000)",
    "write outside": f"open({str(Path(__file__).with_name('pwned.txt'))!r}, 'w').write('pwned')",
    "read a secret": "import os\nprint(os.environ['VERL_TEST_SECRET'])",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 1), timeout=1)",
    "kill parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    "sleep": "import time\ntime.sleep(60)",
}


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_hostile_responses_score_zero_with_their_reason(monkeypatch, executor):
    """Through the reward manager as the trainer calls it: every sample 0, its status and reason in the
    sample's extras (what samples.jsonl records), and this process alive; the same from reward worker
    processes (reward.executor=process), which are their parents there."""
    monkeypatch.setenv("VERL_TEST_SECRET", "hunter2")
    manager = RewardManager([{"name": "code_exec", "kwargs": {"timeout_s": 2, "memory_mb": 256}}])
    manager.configure(workers=4, executor=executor)
    responses = list(HOSTILE.values())
    result = manager.score([None] * len(responses), responses, ["ok"] * len(responses))
    assert result.scores.tolist() == [0.0] * len(responses)
    statuses = {name: extras["code_exec"]["status"] for name, extras in zip(HOSTILE, result.extras, strict=True)}
    assert statuses == {"infinite loop": "timeout", "fork bomb": "timeout", "memory hog": "memory",
                        "huge output": "killed", "write outside": "error", "read a secret": "error",
                        "socket": "error", "kill parent": "error", "sleep": "timeout"}
    assert all(extras["code_exec"]["reason"].startswith("test 1 of 1: ") for extras in result.extras)
    timed_out = sum(status == "timeout" for status in statuses.values())  # a metric of its own: a limit too tight
    assert result.metrics["reward/code_exec/sandbox_timeouts"] == pytest.approx(timed_out / len(responses))
    assert not Path(__file__).with_name("pwned.txt").exists()


def test_the_cache_runs_an_identical_program_once(monkeypatch):
    runs = []
    real = code_exec_module.run_code
    monkeypatch.setattr(code_exec_module, "run_code", lambda *a, **k: runs.append(a) or real(*a, **k))
    monkeypatch.setattr(code_exec_module, "_CACHE", type(code_exec_module._CACHE)())
    for _ in range(3):
        assert code_exec(None, "2+3", "5", program="print({code})", cache_size=8)["score"] == 1.0
    assert code_exec(None, "2+3", "5", program="print({code})")["score"] == 1.0  # no cache: runs again
    assert len(runs) == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"extract": "first"}, "kwargs.extract"),
    ({"program": "print(x)"}, r"must be a string containing \{code\}"),
    ({"timeout_s": 0}, "kwargs.timeout_s must be a positive number"),
    ({"cache_size": -1}, "kwargs.cache_size"),
])
def test_bad_options_fail_when_the_rewards_are_built(kwargs, message):
    with pytest.raises(RewardError, match=message):
        RewardManager([{"name": "code_exec", "kwargs": kwargs}])


def test_python_tool_answers_with_the_output_or_the_failure():
    tools = check_tools([python_tool(timeout_s=2), python_tool(max_output_chars=100, name="short")], "test")

    def call(code: str, name: str = "python"):
        return run_tool(tools, ToolCall(name=name, arguments={"code": code}))

    assert call("print(2 ** 10)").text == "1024" and not call("print(1)").error
    traceback = call("1 / 0")
    assert not traceback.error and traceback.text.endswith("ZeroDivisionError: division by zero")
    assert "<string>" not in traceback.text  # the sandbox's own loader is not in the model's traceback
    slow = call("import time\ntime.sleep(10)")
    assert slow.error and "2 s wall-clock limit" in slow.text
    long = call("print('x' * 1000)", "short")
    assert long.text.startswith("x" * 100) and long.text.endswith("(900 more characters)")
    assert call("pass").text == "(no output)"
