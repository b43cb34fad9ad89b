"""`code_exec`: the share of a row's tests that the response's code passes, each run in verl.sandbox.

The tests are the row's ground truth, in the layouts code datasets use (a JSON string of them works too):
  - stdin/stdout pairs: {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]} (APPS, TACO, PRIME, DeepCoder);
    outputs compare line by line, trailing whitespace and blank lines ignored;
  - assert-style tests: a list of "assert f(1) == 2" strings, or {"asserts": [...], "setup": "import math"}
    (MBPP's test_list and test_setup_code), judged outside the program's process (verl.rewards.assert_tests:
    a program that exits before its tests ran scores 0 with `exited_before_tests`);
  - a plain string or number: what the program must print, with no input (a single test).
The code is the response's last fenced ``` block (any language tag, or none), else the whole response
(`extract: fenced` demands a block). `program` wraps it before it runs: "print({code})" makes the response
an expression. Every test is a fresh sandbox run (a program cannot forge another test's result); a
stdin/stdout test compares only what the program itself printed. `cache_size: N` keeps the last N verdicts
of programs that ended on their own, so a program seen before with the same test is not run again (for
deterministic programs only).

The score is passed / tests; `acc` is 1 when every test passes. A failure's status and reason (timeout,
memory, killed, error with its last line) go with the sample into samples.jsonl.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from verl.rewards.assert_tests import HARNESS, AssertTest, new_secret, parse_test, verdict
from verl.sandbox import run_code

_CACHE: OrderedDict[tuple, tuple[str, str]] = OrderedDict()  # (test, limits) -> (status, reason), most recent last
_CACHE_LOCK = threading.Lock()
_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
CODE_MARK = "{code}"


HARNESS_OUTPUT_BYTES = 1 << 20  # a test's values come back on stdout
ENDED_ON_ITS_OWN = ("ok", "error", "wrong_answer", "exited_before_tests", "exited_during_tests")


@dataclass(frozen=True)
class CodeTest:
    """One run: a stdin/stdout test (its stdin and the output it must print) or an assert-style test."""

    code: str
    stdin: str = ""
    expected: str | None = None
    assertion: AssertTest | None = None


def extract_code(response: str, extract: Literal["auto", "fenced", "all"] = "auto") -> str | None:
    """The code in a response: its last fenced block, or (auto/all) the whole text; None when there is none."""
    blocks = _FENCE.findall(response) if extract != "all" else []
    if blocks:
        return blocks[-1]
    return None if extract == "fenced" else response.strip()


def _same_output(got: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        out = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out

    return lines(got) == lines(expected)


def cases_of(code: str, ground_truth: Any) -> list[CodeTest]:
    """The runs that test `code` against a row's ground truth (see the module docstring for the layouts)."""
    tests = ground_truth
    if isinstance(tests, str):
        try:
            parsed = json.loads(tests)
        except ValueError:
            parsed = None
        if isinstance(parsed, (dict, list)):
            tests = parsed
    if isinstance(tests, Mapping) and ("inputs" in tests or "outputs" in tests):
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
            raise ValueError("stdin/stdout tests need lists 'inputs' and 'outputs' of the same, non-zero length; "
                             f"got {len(inputs or [])} inputs and {len(outputs or [])} outputs")
        return [CodeTest(code, str(i), str(o)) for i, o in zip(inputs, outputs, strict=True)]
    if isinstance(tests, Mapping) and "asserts" in tests:
        setup, tests = str(tests.get("setup") or ""), tests["asserts"]
    else:
        setup = ""
    if isinstance(tests, list):
        if not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("assert-style tests must be a non-empty list of strings like 'assert f(1) == 2'")
        return [CodeTest(code, assertion=parse_test(t, setup)) for t in tests]
    if isinstance(tests, (str, int, float)) and not isinstance(tests, bool):
        return [CodeTest(code, "", str(tests))]
    raise ValueError(f"code_exec cannot read tests from a ground truth of type {type(tests).__name__}: give "
                     "{'inputs': [...], 'outputs': [...]}, a list of assert strings, or the expected output")


def _judge(case: CodeTest, timeout_s: float, memory_mb: int) -> tuple[str, str]:
    """(status, reason) of one fresh run: ("ok", "") when the test passed."""
    if case.assertion is None:
        result = run_code(case.code, case.stdin, timeout_s=timeout_s, memory_mb=memory_mb)
        if not result.ok:
            return result.status, result.reason
        if case.expected is None or _same_output(result.stdout, case.expected):
            return "ok", ""
        return "wrong_answer", (f"printed {result.stdout.strip()[:80]!r}, "
                                f"expected {str(case.expected).strip()[:80]!r}")
    secret = new_secret()  # on stdin, read by the harness before the program runs
    result = run_code(HARNESS, secret + "\n", timeout_s=timeout_s, memory_mb=memory_mb,
                      files=case.assertion.files(case.code), max_output_bytes=HARNESS_OUTPUT_BYTES)
    if result.status not in ("ok", "error"):
        return result.status, result.reason
    status, reason = verdict(case.assertion, secret, result.stdout)
    if status == "exited_before_tests" and result.status == "error":  # it failed to load: say why
        return "error", result.reason
    return status, reason


def _run(case: CodeTest, timeout_s: float, memory_mb: int, cache_size: int) -> tuple[str, str]:
    """A fresh run's verdict; with `cache_size`, an identical program with the same test and limits that ran
    before gives its verdict again (for deterministic programs, as the demo's expressions are)."""
    key = (case, timeout_s, memory_mb)
    if cache_size:
        with _CACHE_LOCK:
            if key in _CACHE:
                _CACHE.move_to_end(key)
                return _CACHE[key]
    judged = _judge(case, timeout_s, memory_mb)
    if cache_size and judged[0] in ENDED_ON_ITS_OWN:  # a timeout or a kill may depend on the machine's load
        with _CACHE_LOCK:
            _CACHE[key] = judged
            while len(_CACHE) > cache_size:
                _CACHE.popitem(last=False)
    return judged


def code_exec(
    prompt: Any,
    response: str,
    ground_truth: Any,
    *,
    extract: Literal["auto", "fenced", "all"] = "auto",
    program: str | None = None,
    timeout_s: float = 10.0,
    memory_mb: int = 512,
    stop_at_first_failure: bool = False,
    cache_size: int = 0,
    **_metadata: Any,
) -> dict[str, Any]:
    """{score: passed / tests, acc, passed, tests, sandbox_timeouts, status, reason}; see the module docstring.
    `sandbox_timeouts` counts the tests whose run hit `timeout_s` (logged as reward/code_exec/sandbox_timeouts):
    on a loaded machine a limit too tight for it turns into zero rewards, which this shows."""
    code = extract_code(response, extract)
    if code is None:
        return {"score": 0.0, "acc": 0.0, "passed": 0, "tests": len(cases_of("", ground_truth)), "sandbox_timeouts": 0,
                "status": "no_code", "reason": "no fenced ``` code block"}
    if program is not None:
        code = program.replace(CODE_MARK, code)
    cases = cases_of(code, ground_truth)
    passed, timeouts, failure = 0, 0, None
    for i, case in enumerate(cases):
        status, reason = _run(case, timeout_s, memory_mb, cache_size)
        timeouts += status == "timeout"
        if status == "ok":
            passed += 1
            continue
        if failure is None:
            failure = (status, f"test {i + 1} of {len(cases)}: {reason}")
        if stop_at_first_failure:
            break
    status, reason = failure or ("ok", "")
    return {"score": passed / len(cases), "acc": float(passed == len(cases)), "passed": passed,
            "tests": len(cases), "sandbox_timeouts": timeouts, "status": status, "reason": reason}


code_exec.needs_ground_truth = True  # the tests are the ground truth (see verl.rewards.builtin.needs_ground_truth)


def check_code_exec_kwargs(kwargs: Mapping[str, Any]) -> None:
    """Bad options fail when the reward functions are built, not at the first batch."""
    if kwargs.get("extract", "auto") not in ("auto", "fenced", "all"):
        raise ValueError(f"kwargs.extract must be 'auto', 'fenced' or 'all', got {kwargs['extract']!r}")
    program = kwargs.get("program")
    if program is not None and (not isinstance(program, str) or CODE_MARK not in program):
        raise ValueError(f"kwargs.program must be a string containing {CODE_MARK} (where the response's code goes), "
                         f"got {program!r}")
    for key in ("timeout_s", "memory_mb"):
        value = kwargs.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"kwargs.{key} must be a positive number, got {value!r}")
    size = kwargs.get("cache_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"kwargs.cache_size must be an int >= 0 (0: run every program), got {size!r}")


__all__ = ["CodeTest", "check_code_exec_kwargs", "code_exec", "extract_code", "cases_of"]
