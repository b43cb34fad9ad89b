"""ArithmeticEnv: deterministic disjoint splits, correct answers, SFT pairs, resumable order."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch

from verl.env import ArithmeticEnv, Environment, arithmetic_sft_pairs
from verl.errors import CheckpointError, ConfigError

_PROBLEM = re.compile(r"^(\d+)([-+*])(\d+)=$")


def _reference_answer(prompt: str) -> int:
    a, op, b = _PROBLEM.match(prompt).groups()  # type: ignore[union-attr]
    a_i, b_i = int(a), int(b)
    return {"+": a_i + b_i, "-": a_i - b_i, "*": a_i * b_i}[op]


def test_rows_are_correct_short_and_disjoint() -> None:
    env = ArithmeticEnv(seed=3, num_val=20, max_operand=9, ops=("+", "-", "*"))
    assert isinstance(env, Environment)
    train = [env.get_batch(1)[0] for _ in range(len(env))]
    val = env.val_rows()
    assert len(val) == 20
    # Every distinct non-negative problem over 0..9: 100 "+", 55 "-" (a >= b), 100 "*".
    assert len(env) == 255 - 20
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    for row in train + val:
        assert set(row) == {"prompt", "ground_truth", "data_source", "metadata"}
        assert row["data_source"] == "arithmetic" and len(row["prompt"]) <= 6
        assert int(row["ground_truth"]) == _reference_answer(row["prompt"]) >= 0


def test_same_seed_same_problems_other_seed_differs() -> None:
    a, b, c = (ArithmeticEnv(seed=s, num_train=50, num_val=10) for s in (0, 0, 1))
    assert a.val_rows() == b.val_rows() and a.get_batch(50) == b.get_batch(50)
    assert a.val_rows() != c.val_rows()


def test_split_seed_fixes_the_held_out_problems_while_the_seed_orders_prompts() -> None:
    a, b = (ArithmeticEnv(seed=s, split_seed=7, num_train=50, num_val=10) for s in (0, 1))
    assert a.val_rows() == b.val_rows() == ArithmeticEnv(seed=7, num_train=50, num_val=10).val_rows()
    first = [r["prompt"] for r in a.get_batch(50)]
    second = [r["prompt"] for r in b.get_batch(50)]
    assert sorted(first) == sorted(second) and first != second


def test_allow_negative_and_num_train() -> None:
    env = ArithmeticEnv(num_train=20, num_val=10, max_operand=5, ops=["-"], allow_negative=True)
    rows = env.get_batch(20) + env.val_rows()
    assert len(env) == 20 and any(int(r["ground_truth"]) < 0 for r in rows)
    for r in rows:
        assert int(r["ground_truth"]) == _reference_answer(r["prompt"])


def test_reward_scores_correct_answers() -> None:
    env = ArithmeticEnv(num_train=8, num_val=0)
    rows = env.get_batch(8)
    right = [str(_reference_answer(r["prompt"])) for r in rows]
    res = env.compute_reward(rows, right)
    assert res.scores.tolist() == [1.0] * 8
    wrong = [str(int(x) + 1) for x in right]
    assert env.compute_reward(rows, wrong).scores.tolist() == [0.0] * 8
    assert env.compute_reward(rows[:1], ["the answer is " + right[0]]).scores.tolist() == [1.0]


def test_sft_pairs_come_from_train_split_and_score_one() -> None:
    kwargs = {"seed": 1, "num_train": 30, "num_val": 15, "max_operand": 9, "answer_template": "#### {answer}"}
    env = ArithmeticEnv(**kwargs)
    pairs = arithmetic_sft_pairs(**kwargs)
    assert len(pairs) == 30 and pairs == env.sft_pairs()
    assert arithmetic_sft_pairs(5, **kwargs) == pairs[:5]
    val_prompts = {r["prompt"] for r in env.val_rows()}
    assert not val_prompts & {p for p, _ in pairs}
    rows = [
        {"prompt": p, "ground_truth": str(_reference_answer(p)), "data_source": "arithmetic"}
        for p, _ in pairs
    ]
    assert env.compute_reward(rows, [a for _, a in pairs]).scores.tolist() == [1.0] * 30
    assert pairs[0][1].startswith("#### ")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"max_operand": 2, "ops": ["+"], "num_val": 9}, r"only 9 distinct ones; raise max_operand"),
        ({"ops": ["/"]}, r"unsupported operators \['/'\]"),
        ({"ops": ["+", "+"]}, r"lists an operator twice"),
        ({"ops": []}, r"unsupported operators"),
        ({"max_operand": 0}, r"env.kwargs.max_operand must be an int >= 1, got 0"),
        ({"num_train": 0}, r"num_train must be an int >= 1"),
        ({"split_seed": -1}, r"env.kwargs.split_seed must be an int >= 0"),
        ({"prompt_template": "{x}+{b}"}, r"cannot be formatted"),
        ({"answer_template": "{answer} (checked 2 times)"}, r"last number is not the answer"),
    ],
)
def test_bad_arithmetic_kwargs(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        ArithmeticEnv(**kwargs)


def test_epoch_visits_each_row_once_and_epochs_differ() -> None:
    env = ArithmeticEnv(num_train=12, num_val=4, max_operand=5)
    first = [r["prompt"] for r in env.get_batch(12)]
    second = [r["prompt"] for r in env.get_batch(12)]
    assert sorted(first) == sorted(second) and len(set(first)) == 12
    assert first != second and env.epoch == 1


def test_batch_crossing_epoch_stays_full() -> None:
    env = ArithmeticEnv(num_train=10, num_val=0, max_operand=5)
    seen = [r["prompt"] for _ in range(5) for r in env.get_batch(4)]  # 20 rows = two epochs exactly
    assert len(seen) == 20
    assert sorted(seen[:10]) == sorted(seen[10:])
    assert env.epoch == 1 and env.state_dict()["position"] == 10


def test_order_ignores_global_rng_and_resumes_exactly() -> None:
    ref = ArithmeticEnv(num_train=10, num_val=0, max_operand=5)
    want = [r["prompt"] for _ in range(8) for r in ref.get_batch(3)]

    env = ArithmeticEnv(num_train=10, num_val=0, max_operand=5)
    got = [r["prompt"] for _ in range(3) for r in env.get_batch(3)]
    state = env.state_dict()
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    resumed = ArithmeticEnv(num_train=10, num_val=0, max_operand=5)
    resumed.load_state_dict(state)
    got += [r["prompt"] for _ in range(5) for r in resumed.get_batch(3)]
    assert got == want


def test_load_state_dict_rejects_other_run() -> None:
    env = ArithmeticEnv(num_train=10, num_val=0, max_operand=5)
    other = ArithmeticEnv(seed=9, num_train=10, num_val=0, max_operand=5)
    with pytest.raises(CheckpointError, match=r"seed: checkpoint 9 vs now 0.*Use the same seed"):
        env.load_state_dict(other.state_dict())
    with pytest.raises(CheckpointError, match=r"missing \['position'\]"):
        env.load_state_dict({k: v for k, v in env.state_dict().items() if k != "position"})
    with pytest.raises(CheckpointError, match="corrupt"):
        env.load_state_dict({**env.state_dict(), "position": 11})


def test_rows_are_copies_and_batch_size_checked() -> None:
    env = ArithmeticEnv(num_train=5, num_val=0, max_operand=5, shuffle=False)
    env.get_batch(1)[0]["metadata"]["x"] = 1
    env.load_state_dict({**env.state_dict(), "position": 0})
    assert env.get_batch(1)[0]["metadata"] == {}
    with pytest.raises(ConfigError, match=r"train_batch_size=6 is larger than the 5 training prompts"):
        env.get_batch(6)
    with pytest.raises(ConfigError, match="positive int"):
        env.get_batch(0)
