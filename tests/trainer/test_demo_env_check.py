"""`trainer.demo` names a recipe written for one environment; another one is refused before anything loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verl.config.loader import build_config
from verl.errors import ConfigError
from verl.trainer.demo import warm_start_until
from verl.trainer.startup import check_demo_env, check_startup


def _config(demo, env):
    return build_config({"model": {"path": "tiny", "dtype": "float32"}, "env": {"name": env},
                         "trainer": {"device": "cpu", "demo": demo}})


@pytest.mark.parametrize("demo,env,want", [("tool", "arithmetic", "calculator"),
                                           ("arithmetic", "calculator", "arithmetic")])
def test_a_demo_on_another_builtin_env_is_refused_at_start_up(demo, env, want):
    problems = check_startup(_config(demo, env), world_size=1).problems
    messages = [str(p) for p in problems if f"trainer.demo={demo}" in str(p)]
    assert len(messages) == 1 and f"env.name: {want}" in messages[0] and "remove trainer.demo" in messages[0]
    assert isinstance(next(p for p in problems if f"trainer.demo={demo}" in str(p)), ConfigError)


@pytest.mark.parametrize("demo,env", [("tool", "calculator"), ("arithmetic", "arithmetic"), (None, "calculator"),
                                      ("tool", "my_env.py:Calc")])
def test_matching_envs_no_demo_and_user_classes_pass(demo, env):
    assert check_demo_env(_config(demo, env)) == []


def test_the_arithmetic_warm_start_names_what_the_env_lacks():
    trainer = SimpleNamespace(env=object())
    with pytest.raises(ConfigError, match="sft_pairs"):
        warm_start_until(trainer, 0.4, 10)
