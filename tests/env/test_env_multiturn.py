"""Multi-turn environments load from `env.name: file.py:Class` and are checked like single-turn ones."""

from __future__ import annotations

import textwrap

import pytest

from verl.env import CalculatorEnv, build_env, is_multiturn
from verl.env.loader import load_env_class
from verl.errors import ConfigError

TOOL_ENV = textwrap.dedent(
    """
    from verl.env import Done, MultiTurnEnv, Observation

    class Shout(MultiTurnEnv):
        def __init__(self, words=("apple", "river", "stone"), seed=0, shuffle=True, max_turns=2):
            rows = [{"prompt": f"Shout {w}:", "ground_truth": w.upper()} for w in words]
            super().__init__(rows[1:], val_rows=rows[:1], max_turns=max_turns, seed=seed, shuffle=shuffle)

        def start(self, row):
            return row["prompt"], {"target": row["ground_truth"]}

        def step(self, state, model_text):
            if model_text.endswith("</upper>"):
                return Observation(" " + model_text.rsplit("<upper>", 1)[-1][:-8].upper(), tool_call=True)
            return Done(reward=float(state["target"] in model_text))

    class NoStep(MultiTurnEnv):
        def __init__(self):
            super().__init__([{"prompt": "x"}])
    """
)


def test_user_multiturn_env_loads_from_a_file(tmp_path):
    (tmp_path / "shout.py").write_text(TOOL_ENV)
    env = build_env({"name": "shout.py:Shout", "kwargs": {"max_turns": 3}}, base_dir=tmp_path, seed=3)
    assert is_multiturn(env) and env.max_turns == 3 and env.max_episode_tokens == 256
    assert len(env) == 2 and env.val_rows()[0]["prompt"] == "Shout apple:"
    prompt, state = env.start(env.val_rows()[0])
    assert env.step(state, "<upper>apple</upper>").text == " APPLE"
    assert env.step(state, "APPLE!").reward == 1.0
    with pytest.raises(ConfigError, match="cannot score single responses"):
        env.compute_reward(env.val_rows(), ["x"])


def test_multiturn_class_without_step_is_refused_at_load(tmp_path):
    (tmp_path / "shout.py").write_text(TOOL_ENV)
    with pytest.raises(ConfigError, match=r"class 'NoStep' .* lacks the method\(s\) step, which the trainer calls. "
                                          r"Add: step\(state, model_text\) -> Observation"):
        load_env_class("shout.py:NoStep", base_dir=tmp_path)


def test_bad_episode_limits_of_a_user_env_fail_when_it_is_built(tmp_path):
    (tmp_path / "shout.py").write_text(TOOL_ENV)
    with pytest.raises(ConfigError, match=r"multi-turn environment Shout: max_turns .* got -1"):
        build_env({"name": "shout.py:Shout", "kwargs": {"max_turns": -1}}, base_dir=tmp_path)


def test_calculator_is_a_built_in_multiturn_env():
    env = build_env({"name": "calculator", "kwargs": {"num_train": 20, "num_val": 4}}, seed=1)
    assert isinstance(env, CalculatorEnv) and is_multiturn(env) and len(env) == 20
    train = {r["prompt"] for r in env.get_batch(20)}
    assert not train & {r["prompt"] for r in env.val_rows()}  # disjoint splits
    with pytest.raises(ConfigError, match="env.kwargs.digit_a is not an option of env 'calculator'. Did you mean "
                                          "'digits_a'"):
        build_env({"name": "calculator", "kwargs": {"digit_a": 2}})


def test_calculator_demonstrations_show_every_product_length_from_the_training_split():
    env = CalculatorEnv(seed=0, num_train=600, num_val=50)
    demos = env.demonstration_problems(20, seed=7)
    lengths = [len(str(a * b)) for a, b in demos]
    natural = [len(str(a * b)) for a, b in env.train_problems]
    assert natural.count(4) < len(natural) / 3  # 4-digit products are the rarer kind ...
    assert lengths.count(4) == lengths.count(5) == 10  # ... but half of the demonstrations
    assert len(set(demos)) == 20 and set(demos) <= set(env.train_problems)
    assert demos == env.demonstration_problems(20, seed=7) and demos != env.demonstration_problems(20, seed=8)
    row, segments = env.formatted_episode(demos[0])
    a, b = demos[0]
    assert "".join(text for text, _ in segments) == f"<calc>{a}*{b}</calc> <result>{a * b}</result> {a * b}"
