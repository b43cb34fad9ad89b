"""The `sandbox` config section: a run that executes model-written code says what isolation it gets, and
refuses to start (in `verl check` too) when it demands what the host cannot give."""

from __future__ import annotations

import importlib

import pytest

from verl.config.loader import build_config
from verl.sandbox import isolation
from verl.trainer.checks.startup import check_startup

isolation_module = importlib.import_module("verl.sandbox.isolation")  # the package's `isolation` is the function


@pytest.fixture(autouse=True)
def restore_defaults(monkeypatch):
    monkeypatch.setattr(isolation_module, "DEFAULTS", dict(isolation_module.DEFAULTS))


def startup(**tree):
    report = check_startup(build_config({"model": {"path": "tiny"}, **tree}), world_size=1, device_type="cpu")
    return report, [str(p) for p in report.problems]


def test_a_code_reward_says_what_isolation_the_host_gives():
    report, problems = startup(reward={"functions": [{"name": "code_exec"}]})
    assert problems == [] and isolation().describe() in report.rl_notes
    plain, _ = startup(reward={"functions": [{"name": "numeric_match"}]})
    assert not any(note.startswith("sandbox:") for note in plain.rl_notes)


def test_demanding_isolation_the_host_lacks_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(isolation_module, "isolation",
                        lambda python=None, namespaces=True: isolation_module.Isolation(False, (), "/usr/bin/python3"))
    _, problems = startup(sandbox={"require": ["network", "pid"]})
    assert len(problems) == 1 and "sandbox.require asks for no network" in problems[0]
    assert "Fix: run the trainer as root" in problems[0]


def test_an_unknown_feature_and_a_missing_interpreter_are_refused():
    _, problems = startup(sandbox={"require": ["gpu"]})
    assert "unknown isolation feature(s) ['gpu']" in problems[0]
    _, problems = startup(reward={"functions": [{"name": "code_exec"}]}, sandbox={"python": "/no/such/python"})
    assert "no Python interpreter at /no/such/python" in problems[0] and "sandbox.python" in problems[0]
