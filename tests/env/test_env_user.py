"""`env.name: path/to/file.py:Class` loads a user's environment class, checked before it is built."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from verl.env import build_env
from verl.env.loader import REQUIRED_METHODS, load_env_class
from verl.errors import ConfigError, VerlError

# A complete user environment: a PromptEnv subclass whose rows come from its constructor's kwargs.
GOOD_ENV = textwrap.dedent(
    """
    from verl.env import PromptEnv
    from verl.rewards import RewardManager

    class CountingEnv(PromptEnv):
        def __init__(self, upto, seed=0, shuffle=True, template="{i}+1="):
            rows = [{"prompt": template.format(i=i), "ground_truth": str(i + 1), "data_source": "count",
                     "metadata": {}} for i in range(upto)]
            manager = RewardManager([{"name": "numeric_match", "data_sources": ["count"]}])
            super().__init__(rows[2:], manager, val_rows=rows[:2], seed=seed, shuffle=shuffle)
            self.seen_seed, self.seen_shuffle = seed, shuffle
    """
)

# Everything but state_dict/load_state_dict: written from scratch, not a PromptEnv.
PARTIAL_ENV = textwrap.dedent(
    """
    class NoResume:
        def __len__(self):
            return 1
        def get_batch(self, batch_size):
            return [{"prompt": "1+1=", "ground_truth": "2"}] * batch_size
        def compute_reward(self, rows, responses):
            raise NotImplementedError
        def val_rows(self):
            return []
    """
)


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def test_file_class_is_built_with_kwargs_seed_and_shuffle(tmp_path: Path) -> None:
    _write(tmp_path, "my_env.py", GOOD_ENV)
    env = build_env({"name": "my_env.py:CountingEnv", "kwargs": {"upto": 10, "template": "{i} plus 1 is"}},
                    base_dir=tmp_path, seed=7, shuffle=False)
    assert type(env).__name__ == "CountingEnv"
    assert len(env) == 8 and [r["prompt"] for r in env.val_rows()] == ["0 plus 1 is", "1 plus 1 is"]
    assert env.seen_seed == 7 and env.seen_shuffle is False  # trainer.seed / data.shuffle reach the class
    batch = env.get_batch(3)
    assert [r["prompt"] for r in batch] == ["2 plus 1 is", "3 plus 1 is", "4 plus 1 is"]  # unshuffled order
    assert env.compute_reward(batch, ["3", "5", "x"]).scores.tolist() == [1.0, 0.0, 0.0]
    state = env.state_dict()
    after = env.get_batch(2)
    env.load_state_dict(state)
    assert env.get_batch(2) == after


def test_absolute_path_and_config_object(tmp_path: Path) -> None:
    path = _write(tmp_path, "envs.py", GOOD_ENV)

    class Section:  # what RunConfig.env looks like to build_env
        name = f"{path}:CountingEnv"
        kwargs = {"upto": 5}

    assert len(build_env(Section(), base_dir="/nonexistent")) == 3


def test_module_spec_loads_a_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, "pkg_user_env_mod.py", GOOD_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = build_env("pkg_user_env_mod:CountingEnv", upto=4)
    assert len(env) == 2


def test_missing_method_names_file_class_and_method(tmp_path: Path) -> None:
    path = _write(tmp_path, "partial.py", PARTIAL_ENV)
    with pytest.raises(ConfigError) as info:
        build_env("partial.py:NoResume", base_dir=tmp_path)
    message = str(info.value)
    assert str(path.resolve()) in message and "class 'NoResume'" in message
    assert "state_dict, load_state_dict" in message and "get_batch," not in message
    assert "Subclassing verl.env.PromptEnv" in message  # the fix


def test_every_required_method_is_checked(tmp_path: Path) -> None:
    for method in REQUIRED_METHODS:
        body = "\n".join(f"    def {m}(self, *a):\n        return None" for m in REQUIRED_METHODS if m != method)
        _write(tmp_path, f"lacks{method.strip('_')}.py", f"class Env:\n{body}\n")
        with pytest.raises(ConfigError, match=rf"lacks the method\(s\) {method}, which the trainer calls"):
            load_env_class(f"lacks{method.strip('_')}.py:Env", base_dir=tmp_path)


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        ("missing.py:Env", r"environment file missing.py does not exist: tried .*missing.py \(the working directory\)"
                           r".*\(the path before ':'\)"),
        ("my_env.py:CountingEvn", r"has no class 'CountingEvn'. Did you mean 'CountingEnv'\?"),
        ("my_env.py:helper", r"'helper' in file .*my_env.py is a function, not a class"),
        ("broken.py:Env", r"importing environment file .*broken.py raised ZeroDivisionError: division by zero"),
        ("no_such_pkg_for_verl_env:Env", r"module 'no_such_pkg_for_verl_env' cannot be imported"),
        ("my_env.py:", r"must be 'path/to/file.py:Class' or 'package.module:Class'"),
    ],
)
def test_load_errors_say_what_where_and_fix(tmp_path: Path, spec: str, pattern: str) -> None:
    _write(tmp_path, "my_env.py", GOOD_ENV + "\ndef helper():\n    pass\n")
    _write(tmp_path, "broken.py", "x = 1 / 0\n")
    with pytest.raises(ConfigError, match=pattern):
        build_env(spec, base_dir=tmp_path, upto=4)


def test_kwargs_are_checked_against_the_constructor(tmp_path: Path) -> None:
    _write(tmp_path, "my_env.py", GOOD_ENV)
    with pytest.raises(ConfigError, match=r"env.kwargs.uptoo is not a parameter of CountingEnv.__init__. "
                                          r"Did you mean 'upto'\?"):
        build_env({"name": "my_env.py:CountingEnv", "kwargs": {"uptoo": 3}}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"env.kwargs.seed is set by the run itself"):
        build_env({"name": "my_env.py:CountingEnv", "kwargs": {"upto": 3, "seed": 1}}, base_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"cannot be called with \[\].*missing a required argument: 'upto'"):
        build_env("my_env.py:CountingEnv", base_dir=tmp_path)


def test_constructor_errors_are_reported_with_the_class(tmp_path: Path) -> None:
    # The user's own code failing is wrapped with the spec and the class name.
    _write(tmp_path, "raises.py", "class Env:\n    def __init__(self, n):\n        raise ValueError(f'bad n {n}')\n"
           + "".join(f"    def {m}(self, *a):\n        return None\n" for m in REQUIRED_METHODS))
    with pytest.raises(ConfigError, match=r"Env\(\*\*env.kwargs\) raised ValueError: bad n 3"):
        build_env({"name": "raises.py:Env", "kwargs": {"n": 3}}, base_dir=tmp_path)
    _write(tmp_path, "verl_raises.py", "from verl.errors import DataError\nclass Env:\n    def __init__(self):\n"
           "        raise DataError('rows file is empty')\n"
           + "".join(f"    def {m}(self, *a):\n        return None\n" for m in REQUIRED_METHODS))
    with pytest.raises(VerlError, match=r"^rows file is empty$"):  # a VerlError passes through unchanged
        build_env("verl_raises.py:Env", base_dir=tmp_path)


def test_registered_names_cannot_contain_a_colon() -> None:
    from verl.env import register_env

    with pytest.raises(ConfigError, match=r"contains ':'"):
        register_env("a:b", lambda ctx: None)  # type: ignore[arg-type,return-value]


def test_rl_trainer_trains_on_a_user_env_named_in_yaml(tmp_path: Path) -> None:
    import json

    from verl.config import load_config
    from verl.trainer.rl_trainer import RLTrainer

    project = tmp_path / "project"
    (project / "envs").mkdir(parents=True)
    _write(project / "envs", "counting.py", GOOD_ENV)
    config_path = _write(project, "run.yaml", textwrap.dedent(
        f"""
        model: {{path: tiny, dtype: float32}}
        env:
          name: envs/counting.py:CountingEnv   # relative to this file
          kwargs: {{upto: 12}}
        data: {{train_batch_size: 4}}
        rollout: {{n: 2, max_new_tokens: 3}}
        actor: {{lr: 1.0e-3}}
        trainer: {{total_steps: 2, device: cpu, resume: never, val_before_train: true,
                   run_dir: {tmp_path / 'run'}}}
        logging: {{backends: [jsonl]}}
        """
    ))
    trainer = RLTrainer(load_config(config_path, overrides=["trainer.cpu_threads=1"]))
    assert type(trainer.env).__name__ == "CountingEnv" and len(trainer.env) == 10
    history = trainer.fit()
    assert trainer.step_count == 2 and "val/accuracy" in history[0]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "reward/mean" in rows[1]
    # two batches of 4 came from the user env's order, and its state is what a checkpoint saves
    fresh = build_env({"name": "envs/counting.py:CountingEnv", "kwargs": {"upto": 12}}, base_dir=project,
                      seed=trainer.config.trainer.seed)
    fresh.get_batch(4)
    fresh.get_batch(4)
    assert trainer.trainer_state()["env"] == fresh.state_dict()
