"""Reward hacks a policy would find against `code_exec`, each scoring nothing: a test passes only when the
harness saw the program's values and this process judged them. The honest solution passes every test."""

from __future__ import annotations

import textwrap

import pytest

from verl.rewards.assert_tests import parse_test, verdict
from verl.rewards.code_exec import code_exec

TESTS = {"asserts": ["assert add(1, 2) == 3", "assert add(10, -4) == 6", "assert add(0, 0) == 0"]}
WRONG = "def add(a, b):\n    return a - b + 7\n"  # fails all three

HACKS = {
    "sys.exit(0) after a wrong function": WRONG + "import sys\nsys.exit(0)",
    "os._exit(0) after a wrong function": WRONG + "import os\nos._exit(0)",
    "raise SystemExit": WRONG + "raise SystemExit",
    "exit from inside the function": "def add(a, b):\n    import os\n    os._exit(0)",
    "sys.exit from inside the function": "def add(a, b):\n    import sys\n    sys.exit(0)",
    "an __eq__ that is always true": "class Any:\n    def __eq__(self, other):\n        return True\n"
                                     "    __hash__ = object.__hash__\ndef add(a, b):\n    return Any()",
    "an int subclass that equals everything": "class I(int):\n    def __eq__(self, other):\n        return True\n"
                                              "    __hash__ = int.__hash__\ndef add(a, b):\n    return I(a - b + 7)",
    "a list subclass that equals everything": "class L(list):\n    def __eq__(self, o):\n        return True\n"
                                              "def add(a, b):\n    return L()",
    "patch AssertionError": WRONG + "import builtins\nclass Never(BaseException):\n    pass\n"
                                    "builtins.AssertionError = Never",
    "patch the builtins the check uses": WRONG + "import builtins\nbuiltins.abs = lambda x: 0\n"
                                                 "builtins.len = lambda x: 0\nbuiltins.print = lambda *a, **k: None",
    "silence stdout and stderr": WRONG + "import sys, os\nsys.stdout = open(os.devnull, 'w')\nos.close(1)",
    "print a fake verdict": WRONG + "print('loaded')\nprint('[\"holes\", [3]]')\nprint('ok')",
    "read the expected output": textwrap.dedent("""
        import json, os
        found = [open(p).read() for p in os.listdir('.') if os.path.isfile(p)]
        def add(a, b):
            for text in found:
                if '== ' in text:
                    return int(text.split('== ')[1].split('"')[0])
            return None
        """),
    "sys.settrace to rewrite the comparison": WRONG + "import sys\nsys.settrace(lambda *a: None)",
    "an atexit handler that prints success": WRONG + "import atexit\natexit.register(lambda: print('passed'))",
}


@pytest.mark.parametrize("hack", list(HACKS), ids=list(HACKS))
def test_a_reward_hack_scores_nothing(hack):
    out = code_exec(None, HACKS[hack], TESTS)
    assert out["passed"] == 0 and out["score"] == 0.0, (hack, out)


def test_exiting_before_the_tests_is_named():
    for hack in ("sys.exit(0) after a wrong function", "os._exit(0) after a wrong function", "raise SystemExit"):
        out = code_exec(None, HACKS[hack], TESTS)
        assert out["status"] == "exited_before_tests" and "exited before its tests ran" in out["reason"]
    during = code_exec(None, HACKS["exit from inside the function"], TESTS)
    assert during["status"] == "exited_during_tests"


def test_the_honest_solution_and_everyday_test_shapes_pass():
    honest = "def add(a, b):\n    return a + b\n"
    assert code_exec(None, honest, TESTS)["acc"] == 1.0
    code = textwrap.dedent("""
        import math
        from collections import OrderedDict, namedtuple
        P = namedtuple('P', 'x y')
        def pairs(n):
            return [P(i, i * i) for i in range(n)]
        def counts(s):
            return OrderedDict((c, s.count(c)) for c in sorted(set(s)))
        def area(r):
            return math.pi * r * r
        def nothing():
            return None
        """)
    tests = ["assert pairs(3) == [(0, 0), (1, 1), (2, 4)]", "assert counts('abca') == {'a': 2, 'b': 1, 'c': 1}",
             "assert math.isclose(area(1), 3.14159, rel_tol=1e-3)", "assert abs(area(2) - 12.566) < 1e-2",
             "assert nothing() is None", "assert sorted(counts('ba')) == ['a', 'b']", "assert pairs(2)[1][1] == 1",
             "assert len(pairs(4)) == 4 and pairs(1) != []", "assert set(x for x, _ in pairs(3)) == {0, 1, 2}",
             "assert not pairs(0)", "assert 3 == len(pairs(3))"]
    out = code_exec(None, code, {"asserts": tests, "setup": "import math"})
    assert (out["passed"], out["status"]) == (len(tests), "ok"), out


def test_a_test_that_is_not_one_assert_still_runs():
    out = code_exec(None, "def add(a, b):\n    return a + b",
                    ["x = add(1, 2)\nassert x == 3", "y = add(1, 1)\nassert y == 3"])
    assert (out["passed"], out["tests"]) == (1, 2) and out["status"] == "error"


def test_the_expected_values_never_enter_the_sandbox():
    test = parse_test("assert f([1, 2]) == [2, 1] and g(3) > 4.5")
    assert test.holes == ("f([1, 2])", "g(3)")
    files = test.files("def f(x): return x")
    assert "[2, 1]" not in files["test.json"] and "4.5" not in files["test.json"]


@pytest.mark.parametrize("stdout, status", [
    ("", "exited_before_tests"),
    ("S loaded\n", "exited_before_tests"),  # wrong secret: the program's own print
    ('\nSECRET ["loaded", null]\n', "exited_during_tests"),
    ('\nSECRET ["loaded", null]\nSECRET ["holes", [3]]\n', "ok"),
    ('\nSECRET ["loaded", null]\nSECRET ["holes", [{"list": []}]]\n', "wrong_answer"),
    ('\nSECRET ["loaded", null]\nSECRET ["holes", [3, 4]]\n', "error"),
    ('\nSECRET ["loaded", null]\nSECRET ["passed", null]\n', "error"),  # not a verdict this test may get
    ('\nSECRET ["loaded", null]\nSECRET ["holes", [{"evil": 1}]]\n', "wrong_answer"),
])
def test_the_verdict_reads_only_lines_with_the_secret(stdout, status):
    assert verdict(parse_test("assert f(1) == 3"), "SECRET", stdout)[0] == status


def test_an_iterator_feeds_the_calls_that_consume_it_but_equals_no_list():
    code = "def evens(n):\n    return (i for i in range(0, n, 2))"
    tests = ["assert list(evens(5)) == [0, 2, 4]", "assert sorted(evens(3), reverse=True) == [2, 0]",
             "assert sum(evens(5)) == 6", "assert evens(5) == [0, 2, 4]"]
    out = code_exec(None, code, tests)
    assert (out["passed"], out["status"]) == (3, "wrong_answer"), out
