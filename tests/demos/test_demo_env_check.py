"""`trainer.demo` names a recipe written for one environment; another one is refused before anything loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verl.config.loader import build_config
from verl.demos.arithmetic import warm_start_until
from verl.errors import ConfigError
from verl.trainer.checks.startup import check_demo_env, check_startup


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


def test_the_arithmetic_warm_start_probes_problems_it_does_not_train_on(monkeypatch):
    import verl.demos.arithmetic as demo

    taught = {}

    class FakeSFT:
        def train_steps(self, n):
            return [{"loss": 0.0}] * n

    def fake_sft(trainer, train_rows):
        taught["rows"] = train_rows
        return FakeSFT()

    probed = []
    pairs = [(f"{i}+1=", str(i + 1)) for i in range(20)]
    trainer = SimpleNamespace(env=SimpleNamespace(sft_pairs=lambda: pairs),
                              evaluate=lambda rows, prefix: probed.append(rows) or {"train/accuracy": 1.0})
    monkeypatch.setattr(demo, "constant_lr_sft", fake_sft)
    steps, acc, _ = warm_start_until(trainer, 0.4, 100)
    assert steps == 10 and acc == 1.0
    probe = [r["prompt"] for r in probed[0]]
    assert probe == [p for p, _ in pairs[:5]]  # a quarter of 20: small envs keep most problems to learn from
    assert {r["input"] for r in taught["rows"]}.isdisjoint(probe) and len(taught["rows"]) == 15
    trainer.env = SimpleNamespace(sft_pairs=lambda: pairs[:3])
    with pytest.raises(ConfigError, match="at least 4 training problems"):
        warm_start_until(trainer, 0.4, 100)


@pytest.mark.parametrize("env,demo,refused", [("arithmetic", None, True), ("calculator", "tool", True),
                                              (None, None, False), ("my_env.py:Env", None, False)])
def test_data_files_next_to_a_self_contained_env_are_refused_not_ignored(env, demo, refused):
    config = build_config({"model": {"path": "tiny", "dtype": "float32"}, "env": {"name": env},
                           "data": {"train_files": ["train.jsonl"]}, "trainer": {"device": "cpu", "demo": demo}})
    problems = [str(p) for p in check_startup(config, world_size=1).problems if "would not be read" in str(p)]
    assert len(problems) == int(refused)
    if refused:
        assert f"env.name={env} makes its own prompts" in problems[0] and "(train.jsonl)" in problems[0]
        assert "Fix: set env.name=null" in problems[0]
        assert ("trainer.demo=null" in problems[0]) == (demo is not None)


def test_without_a_config_file_relative_paths_are_the_users_not_the_presets():
    from argparse import Namespace

    from verl.cli.main import _load

    config = _load(Namespace(items=["reward.functions=[{name: reward.py:fn}]"], command="train", legacy=[]))
    assert config.trainer.demo == "arithmetic" and config._source_dir is None  # resolved against the cwd


@pytest.mark.parametrize("own", ["data.train_files=[train.jsonl]", "env.name=my_env.py:Env"])
def test_without_a_config_file_naming_data_or_an_env_trains_on_the_defaults_not_the_demo(own):
    """volcengine/verl users train from the command line alone: data files (or an env) there are their own
    run, which the demo preset's arithmetic env would refuse."""
    from argparse import Namespace

    from verl.cli.main import _load, runs_demo
    from verl.config.schema import RunConfig

    args = Namespace(items=["model.path=tiny", own], command="train", legacy=[])
    config = _load(args)
    assert not runs_demo(args) and config.trainer.demo is None and config.model.path == "tiny"
    defaults = RunConfig()
    assert config.actor.lr == defaults.actor.lr and config.rollout.n == defaults.rollout.n  # not the preset's
    assert runs_demo(Namespace(items=["model.path=tiny"], command="train", legacy=[]))
    assert not runs_demo(Namespace(items=["cfg.yaml"], command="train", legacy=[]))
    assert runs_demo(Namespace(items=[], command="check", legacy=[]))  # checks what `verl train` would run
    assert not runs_demo(Namespace(items=[own], command="check", legacy=[]))
