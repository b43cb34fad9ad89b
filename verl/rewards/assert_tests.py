"""Assert-style code tests judged outside the program's process, so a program cannot pass one it failed.

A test such as `assert f(1) == [2, 3]` splits into holes, the sub-expressions that need the program (`f(1)`),
and a template that only this process evaluates (`__hole_0 == [2, 3]`). The sandbox runs the program and the
harness (verl/rewards/_assert_harness.py), which reports each hole's value as plain data on stdout lines that
carry a per-run secret; the comparison happens here, on built-in values. So exiting early (`sys.exit(0)`,
`os._exit(0)`: `exited_before_tests`), patching `assert`, `AssertionError` or `print`, overriding `__eq__` on
what it returns, or printing fake results score nothing, and the expected values never enter the sandbox.
The template holds literals, arithmetic other than `*` and `**`, comparisons, `and`/`or`/`not`, indexing and
calls of a few pure builtins (abs, len, sorted, set, min, math.isclose...); anything else (a comprehension,
a method call on the result) is a hole of its own, evaluated in the program's process, whose source the
program could read. A test that is not a single `assert` runs whole inside the sandbox (weaker: a program
able to dig the secret out of its interpreter could forge it).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HARNESS = Path(__file__).with_name("_assert_harness.py").read_text()
HOLE = "__hole_"
CALLS: dict[str, Any] = {f.__name__: f for f in (abs, round, len, sorted, set, frozenset, list, tuple, dict, sum,
                                                   min, max, str, int, float, bool, all, any)}
MATH = {name: getattr(math, name) for name in ("isclose", "fabs", "sqrt", "floor", "ceil", "isnan", "isinf")}
KEYWORDS = {"sorted": {"reverse"}, "isclose": {"rel_tol", "abs_tol"}, "round": {"ndigits"}}
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv,
          ast.Mod: operator.mod}  # no * or **: a value of the program's could make them huge here
UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}
COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
           ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not}


@dataclass(frozen=True)
class AssertTest:
    """One test: the files of its sandbox run and how to judge what the harness printed."""

    source: str
    setup: str
    template: ast.expr | None = field(compare=False)  # None: runs whole in the sandbox (not a single assert)
    holes: tuple[str, ...]

    def files(self, code: str) -> dict[str, str]:
        spec = {"setup": self.setup, "holes": list(self.holes),
                "statement": self.source if self.template is None else None}
        return {"solution.py": code, "test.json": json.dumps(spec)}


def _calls_pure(node: ast.Call) -> bool:
    func = node.func
    name = func.id if isinstance(func, ast.Name) and func.id in CALLS else \
        func.attr if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and \
        func.value.id == "math" and func.attr in MATH else None
    if name is None or any(isinstance(a, ast.Starred) for a in node.args):
        return False
    if name == "sum" and len(node.args) != 1:  # sum(lists, []) is quadratic
        return False
    return all(k.arg in KEYWORDS.get(name, ()) and isinstance(k.value, ast.Constant) for k in node.keywords)


def _host_kind(node: ast.AST) -> bool:
    """Whether this process may evaluate the node itself (its children are judged separately)."""
    if isinstance(node, ast.Call):
        return _calls_pure(node)
    if isinstance(node, ast.BinOp):
        return type(node.op) in BINARY
    if isinstance(node, ast.UnaryOp):
        return type(node.op) in UNARY
    if isinstance(node, ast.Compare):
        return all(type(op) in COMPARE for op in node.ops)
    return isinstance(node, (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.BoolOp, ast.Subscript,
                             ast.Slice)) and not isinstance(getattr(node, "ctx", None), (ast.Store, ast.Del))


class _Split(ast.NodeTransformer):
    def __init__(self) -> None:
        self.holes: list[str] = []

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.expr) and not _host_kind(node):
            self.holes.append(ast.unparse(node))
            return ast.Name(id=f"{HOLE}{len(self.holes) - 1}", ctx=ast.Load())
        if isinstance(node, ast.Call):  # the function itself is ours: keep it, split its arguments
            node.args = [self.visit(a) for a in node.args]
            return node
        return self.generic_visit(node)


def parse_test(source: str, setup: str = "") -> AssertTest:
    """Split an assert-style test into holes and a template (see the module docstring)."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        body = []
    if len(body) != 1 or not isinstance(body[0], ast.Assert):
        return AssertTest(source, setup, None, ())
    split = _Split()
    template = split.visit(body[0].test)
    return AssertTest(source, setup, template, tuple(split.holes))


def _evaluate(node: ast.AST, holes: list[Any]) -> Any:
    """The template's value with the holes filled in: only the node kinds _host_kind allows."""
    def ev(n: ast.AST) -> Any:
        return _evaluate(n, holes)

    if isinstance(node, ast.Name):
        return holes[int(node.id[len(HOLE):])]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](ev(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise TypeError("a ** in a dict display")
        return {ev(k): ev(v) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.BoolOp):
        value = ev(node.values[0])
        for other in node.values[1:]:
            if bool(value) is isinstance(node.op, ast.Or):
                return value
            value = ev(other)
        return value
    if isinstance(node, ast.UnaryOp):
        return UNARY[type(node.op)](ev(node.operand))
    if isinstance(node, ast.BinOp):
        left, right = ev(node.left), ev(node.right)
        if isinstance(node.op, ast.Mod) and isinstance(left, (str, bytes)):
            raise TypeError("% formatting of the program's text")
        return BINARY[type(node.op)](left, right)
    if isinstance(node, ast.Compare):
        left = ev(node.left)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = ev(comparator)
            if not COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Subscript):
        return ev(node.value)[ev(node.slice)]
    if isinstance(node, ast.Slice):
        return slice(*(None if p is None else ev(p) for p in (node.lower, node.upper, node.step)))
    if isinstance(node, ast.Call):
        func = CALLS[node.func.id] if isinstance(node.func, ast.Name) else MATH[node.func.attr]
        return func(*(ev(a) for a in node.args), **{k.arg: k.value.value for k in node.keywords})
    raise TypeError(f"cannot evaluate {type(node).__name__}")


class Iterated(list):
    """What an iterator of the program's yielded: list() or sorted() of it are lists, but like the iterator
    itself it equals nothing but itself."""

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other


def _from_plain(x: Any) -> Any:
    if isinstance(x, list):
        raise ValueError("untagged list")
    if not isinstance(x, dict):
        return x
    (tag, value), = x.items()
    if tag == "float":
        return float(value)
    if tag == "complex":
        return complex(float(value[0]), float(value[1]))
    if tag == "bytes":
        return value.encode("latin-1")
    if tag == "dict":
        return {_from_plain(k): _from_plain(v) for k, v in value}
    kinds = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "iter": Iterated}
    return kinds[tag](_from_plain(i) for i in value)


def new_secret() -> str:
    return secrets.token_hex(16)


def verdict(test: AssertTest, secret: str, stdout: str) -> tuple[str, str]:
    """(status, reason) of one run's harness output: ("ok", "") when the test passed."""
    said = []
    for line in stdout.splitlines():
        if line.startswith(secret + " "):
            try:
                said.append(json.loads(line[len(secret) + 1:]))
            except ValueError:
                continue
    kinds = [s[0] for s in said if isinstance(s, list) and len(s) == 2]
    if "loaded" not in kinds:
        return "exited_before_tests", "the program exited before its tests ran"
    verdicts = [s for s in said if isinstance(s, list) and len(s) == 2 and s[0] in ("holes", "passed", "error")]
    if not verdicts:
        return "exited_during_tests", "the program exited while its test ran"
    kind, value = verdicts[0]
    if kind == "error":
        return "error", str(value)
    if kind == "passed":
        return ("ok", "") if test.template is None else ("error", "a verdict the harness does not give this test")
    if test.template is None or not isinstance(value, list) or len(value) != len(test.holes):
        return "error", "the harness reported values this test does not have"
    try:
        holes = [_from_plain(v) for v in value]
        passed = bool(_evaluate(test.template, holes))
    except Exception as e:  # noqa: BLE001 - a value the test's expression cannot take, e.g. a str for an int
        return "wrong_answer", f"{test.source[:80]}: {type(e).__name__}: {str(e)[:80]}"
    if passed:
        return "ok", ""
    shown = ", ".join(f"{h} = {v!r}"[:80] for h, v in zip(test.holes, holes, strict=True))
    return "wrong_answer", f"{test.source[:80]} is false ({shown})"


__all__ = ["HARNESS", "AssertTest", "new_secret", "parse_test", "verdict"]
