"""The one "did you mean" helper every unknown-name error uses."""

from verl.utils.suggest import closest, did_you_mean


def test_did_you_mean_names_the_closest_choice_or_nothing():
    assert did_you_mean("numeric_mach", ["numeric_match", "math_verify"]) == " Did you mean 'numeric_match'?"
    assert did_you_mean("zzz", ["numeric_match"]) == ""
    assert did_you_mean("lrr", ["lr", "betas"], cutoff=0.5, prefix="actor.") == " Did you mean 'actor.lr'?"
    assert closest("bf61", {"bf16": 1, "fp32": 2}) == "bf16"  # any iterable of names, e.g. a dict's keys


def test_no_module_calls_difflib_but_the_helper():
    from pathlib import Path

    import verl

    root = Path(verl.__file__).parent
    users = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "difflib" in p.read_text())
    assert users == ["utils/suggest.py"]
