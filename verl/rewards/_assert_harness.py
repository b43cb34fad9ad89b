"""The harness of an assert-style code test (runs as main.py inside verl.sandbox; standard library only).

It reads the run's secret from stdin before the program runs (the program finds stdin empty), runs the test's
setup and then the program (solution.py) as module `solution`, says `loaded`, then evaluates the test's
holes (test.json: the sub-expressions that need the program, e.g. `f(1)`) with the builtins as they were
before the program ran, and prints each value as plain data (built-in types only: a subclass is read through
its base type, so an `__eq__` of the program's own never runs; an iterator as its items), every line prefixed with the
secret. The verdict is the launcher's: it compares these values with the test's expected values, which never enter this
process. A test that is not one `assert` runs whole here and reports `passed` (the weaker case).
"""

import builtins
import json
import os
import sys
import types

ITERATORS = (types.GeneratorType, map, filter, zip, reversed, enumerate, range, type({}.keys()),
             type({}.values()), type({}.items()), type(iter([])), type(iter(())), type(iter("")))

LOADED, HOLES, PASSED = "loaded", "holes", "passed"


def plain(x, depth=0):
    """x as tagged JSON-able data; raises TypeError for a value that is not built-in data."""
    if depth > 100:
        raise TypeError("the value nests more than 100 levels deep")
    t = type(x)
    if x is None or t is bool:
        return x
    if isinstance(x, int) and not isinstance(x, bool):
        return int.__int__(x)
    if isinstance(x, float):
        return {"float": float.__repr__(float.__float__(x))}
    if isinstance(x, str):
        return str.__str__(x)
    if t is complex:
        return {"complex": [float.__repr__(x.real), float.__repr__(x.imag)]}
    if isinstance(x, (bytes, bytearray)):
        return {"bytes": bytes(memoryview(x)).decode("latin-1")}
    for base, tag, items in ((list, "list", list.__iter__), (tuple, "tuple", tuple.__iter__),
                             (set, "set", set.__iter__), (frozenset, "frozenset", frozenset.__iter__)):
        if isinstance(x, base):
            return {tag: [plain(i, depth + 1) for i in items(x)]}
    if isinstance(x, dict):
        return {"dict": [[plain(k, depth + 1), plain(v, depth + 1)] for k, v in dict.items(x)]}
    if isinstance(x, ITERATORS):  # e.g. a generator the test passes to list() or sorted()
        return {"iter": [plain(i, depth + 1) for i in x]}
    raise TypeError(f"returned a {t.__module__}.{t.__qualname__}, not built-in data (int, float, str, list, "
                    "tuple, dict, set, bytes, None)")


def main():
    secret = sys.stdin.readline().strip()
    write, dumps, pristine = os.write, json.dumps, dict(builtins.__dict__)

    def say(kind, value=None):
        write(1, ("\n" + secret + " " + dumps([kind, value]) + "\n").encode())

    with open("test.json") as f:
        test = json.load(f)
    with open("solution.py") as f:
        source = f.read()
    space = {"__name__": "solution", "__file__": "solution.py", "__builtins__": builtins}
    if test["setup"]:
        exec(compile(test["setup"], "setup", "exec"), space)
    try:
        exec(compile(source, "solution.py", "exec"), space)
    except SystemExit:
        return 0  # no `loaded`: the program exited before its tests ran
    except BaseException as e:  # noqa: BLE001 - the program's own error, reported as its failure
        import traceback
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        return 1
    say(LOADED)
    scope = {**space, "__builtins__": pristine}
    if test["statement"] is not None:  # the weaker case: the whole test runs in this process
        try:
            exec(compile(test["statement"], "test", "exec"), scope)
        except BaseException as e:  # noqa: BLE001
            say("error", f"{type(e).__name__}: {e}"[:300])
            return 0
        say(PASSED)
        return 0
    values = []
    for i, hole in enumerate(test["holes"]):
        try:
            values.append(plain(eval(compile(hole, f"hole {i}", "eval"), scope)))
        except BaseException as e:  # noqa: BLE001 - the program failed this test
            say("error", f"{hole[:80]}: {type(e).__name__}: {e}"[:300])
            return 0
    say(HOLES, values)
    return 0


if __name__ == "__main__":
    sys.exit(main())
