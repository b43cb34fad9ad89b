"""DatasetEnv over canonical rows, and build_env's registry and config errors."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from verl.env import ArithmeticEnv, DatasetEnv, EnvBuildContext, available_envs, build_env, register_env
from verl.errors import ConfigError, DataError, RewardError
from verl.rewards import RewardManager


def _rows(n: int, source: str | None = "gsm8k") -> list[dict]:
    return [
        {"prompt": f"q{i}", "ground_truth": str(i), "data_source": source, "metadata": {"idx": i}}
        for i in range(n)
    ]


def test_dataset_env_scores_rows_and_passes_metadata(tmp_path: Path) -> None:
    (tmp_path / "rw.py").write_text(
        "def idx_match(prompt, response, ground_truth, idx):\n"
        "    return {'score': float(response == ground_truth), 'idx': float(idx)}\n"
    )
    mgr = RewardManager([{"name": "rw.py:idx_match"}], base_dir=tmp_path)
    env = DatasetEnv(_rows(6), mgr, val_rows=_rows(2), seed=5)
    batch = env.get_batch(4)
    res = env.compute_reward(batch, [r["ground_truth"] for r in batch[:2]] + ["x", "y"])
    assert res.scores.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert res.metrics["reward/idx_match/idx"] == pytest.approx(sum(r["metadata"]["idx"] for r in batch) / 4)
    assert env.val_rows() == _rows(2)


def test_dataset_env_chat_prompts_and_no_shuffle() -> None:
    rows = [{"prompt": [{"role": "user", "content": f"{i}+0="}], "ground_truth": str(i)} for i in range(3)]
    env = DatasetEnv(rows, RewardManager([{"name": "numeric_match"}]), shuffle=False)
    batch = env.get_batch(3)
    assert [r["ground_truth"] for r in batch] == ["0", "1", "2"]
    assert env.compute_reward(batch, ["0", "1", "5"]).scores.tolist() == [1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("bad", "pattern"),
    [
        ("not a dict", r"train row 1 is a str, not a dict"),
        ({"ground_truth": "1"}, r"train row 1: prompt is NoneType \(missing\)"),
        ({"prompt": "  "}, r"train row 1 has an empty prompt"),
        ({"prompt": [{"content": "hi"}]}, r"train row 1: prompt is a message list but entries \[0\]"),
        ({"prompt": "q", "data_source": 3}, r"train row 1: data_source must be a string or null"),
        ({"prompt": "q", "metadata": [1]}, r"train row 1: metadata must be a dict or null"),
    ],
)
def test_bad_rows_name_the_index(bad: object, pattern: str) -> None:
    with pytest.raises(DataError, match=pattern):
        DatasetEnv([_rows(1)[0], bad], RewardManager([{"name": "exact_match"}]))  # type: ignore[list-item]


def test_empty_rows_and_unknown_data_source_fail_at_start() -> None:
    mgr = RewardManager([{"name": "numeric_match", "data_sources": ["gsm8k"]}])
    with pytest.raises(DataError, match="training data has no rows"):
        DatasetEnv([], mgr)
    with pytest.raises(RewardError, match=r"^val data: .*data_source 'gsm8kk' \(sample 1\)"):
        DatasetEnv(_rows(3), mgr, val_rows=[_rows(1)[0], *_rows(1, "gsm8kk")])


def test_build_env_forms() -> None:
    env = build_env("arithmetic", num_train=6, num_val=2, max_operand=4, seed=2)
    assert isinstance(env, ArithmeticEnv) and len(env) == 6
    same = build_env(
        {"name": "arithmetic", "kwargs": {"num_train": 6, "num_val": 2, "max_operand": 4}}, seed=2
    )
    assert same.get_batch(6) == env.get_batch(6)
    section = SimpleNamespace(name=None, kwargs={})
    ds = build_env(
        section, reward_functions=[{"name": "exact_match"}], train_rows=_rows(3), val_rows=_rows(1)
    )
    assert isinstance(ds, DatasetEnv) and len(ds.val_rows()) == 1
    assert {"arithmetic", "dataset"} <= set(available_envs())


def test_build_env_arithmetic_uses_configured_rewards() -> None:
    env = build_env(
        "arithmetic",
        num_train=4,
        num_val=0,
        max_operand=4,
        reward_functions=[{"name": "format", "kwargs": {"pattern": r"^\d+$"}, "weight": 0.5}],
    )
    rows = env.get_batch(2)
    assert env.compute_reward(rows, ["123", "abc"]).scores.tolist() == [0.5, 0.0]


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (
            lambda: build_env("arithmetc"),
            r"env.name 'arithmetc' is not a known environment. Did you mean 'arithmetic'",
        ),
        (
            lambda: build_env("arithmetic", num_tran=3),
            r"env.kwargs.num_tran is not an option.*Did you mean 'num_train'",
        ),
        (
            lambda: build_env("arithmetic", seed=1, shuffle=True, reward_manager=None),
            r"env.kwargs.reward_manager is set by the run itself",
        ),
        (
            lambda: build_env(None, reward_functions=[{"name": "exact_match"}]),
            r"no rows were given; set data.train_files",
        ),
        (lambda: build_env(None, train_rows=_rows(2)), r"reward.functions is empty"),
        (
            lambda: build_env({"name": "dataset", "kwargs": {"x": 1}}, train_rows=_rows(2)),
            r"not used by the dataset",
        ),
        (lambda: build_env({"name": "arithmetic", "num_val": 3}), r"unknown keys \['num_val'\].*env.kwargs"),
        (lambda: build_env(42), r"env config must be a name"),
    ],
)
def test_build_env_errors(call, pattern: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=pattern):
        call()


def test_register_env() -> None:
    def factory(ctx: EnvBuildContext, size: int = 2) -> DatasetEnv:
        rows = _rows(size, None)
        return DatasetEnv(rows, RewardManager([{"name": "exact_match"}]), seed=ctx.seed)

    register_env("tiny_test_env", factory)
    env = build_env({"name": "tiny_test_env", "kwargs": {"size": 3}}, seed=4)
    assert len(env) == 3  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="already registered"):
        register_env("tiny_test_env", factory)


def test_rows_without_the_ground_truth_a_reward_needs_are_named_at_construction():
    from verl.env.base import check_ground_truths
    from verl.errors import DataError
    from verl.rewards import RewardManager

    manager = RewardManager([{"name": "exact_match", "data_sources": ["math"]}, {"name": "format",
                             "kwargs": {"pattern": ".*"}}])
    rows = [{"prompt": "a", "ground_truth": "1", "data_source": "math"},
            {"prompt": "b", "data_source": "math", "file": "t.jsonl", "line": 7},
            {"prompt": "c", "data_source": "chat"},  # only `format` applies: it needs no ground truth
            {"prompt": "d", "ground_truth": None, "data_source": "math"}]
    with pytest.raises(DataError) as err:
        check_ground_truths(manager, rows, "train")
    assert str(err.value).startswith("train data: 2 row(s) have no ground truth, but reward function(s) "
                                     "exact_match need one to score them: t.jsonl:7, train row 3. Fix:")


def test_a_user_function_can_declare_that_it_needs_a_ground_truth():
    from verl.env.base import check_ground_truths
    from verl.errors import DataError
    from verl.rewards import RewardManager
    from verl.rewards.builtin import needs_ground_truth

    @needs_ground_truth
    def mine(prompt, response, ground_truth, **metadata):
        return 1.0

    def relaxed(prompt, response, ground_truth, **metadata):
        return 1.0

    check_ground_truths(RewardManager([relaxed]), [{"prompt": "x"}], "val")
    with pytest.raises(DataError, match=r"^val data: 1 row\(s\) have no ground truth, but reward function\(s\) mine"):
        check_ground_truths(RewardManager([mine]), [{"prompt": "x"}], "val")
