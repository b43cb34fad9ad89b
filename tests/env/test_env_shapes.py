"""The vision demo's `shapes` environment: deterministic pictures, disjoint scenes, uniform answers, exact reward."""

import io
from collections import Counter

import numpy as np
import pytest

from verl.env.registry import build_env
from verl.env.shapes import CELL, PALETTE, ShapesEnv, in_validation
from verl.errors import ConfigError

PIL = pytest.importorskip("PIL.Image")


def small(**kwargs):
    return ShapesEnv(**{"num_train": 200, "num_val": 64, "distractors": 0.5, **kwargs})


def scene_of(row):
    """(board of colour names per cell, asked colour) read back from the picture's pixels."""
    image = PIL.open(io.BytesIO(row["images"][0])).convert("RGB")
    grid = image.size[0] // CELL
    pixels = np.asarray(image).astype(int)
    board = []
    for i in range(grid * grid):
        cell = pixels[(i // grid) * CELL:(i // grid + 1) * CELL, (i % grid) * CELL:(i % grid + 1) * CELL]
        colours = [name for name, rgb in PALETTE.items() if (np.abs(cell - rgb).max(-1) <= 25).sum() >= 14 * 14]
        board.append(colours[0] if colours else None)
    return tuple(board), row["metadata"]["color"]


def test_rows_are_deterministic_from_the_seed_and_differ_across_seeds():
    a, b, c = small(seed=3), small(seed=3), small(seed=4)
    assert a.val_rows() == b.val_rows() and a.sft_rows() == b.sft_rows()
    assert a.val_rows() != c.val_rows()
    assert a.get_batch(8) == b.get_batch(8)


def test_split_seed_fixes_the_problems_whatever_the_run_seed():
    a, b = small(seed=1, split_seed=7), small(seed=2, split_seed=7)
    assert a.val_rows() == b.val_rows()
    assert sorted(r["output"] for r in a.sft_rows()) == sorted(r["output"] for r in b.sft_rows())


@pytest.mark.parametrize(("distractors", "split_seed"), [(0.0, 0), (0.5, 5)])
def test_validation_scenes_never_appear_in_training(distractors, split_seed):
    env = small(split_seed=split_seed, distractors=distractors, num_train=400)
    val = {scene_of(r) for r in env.val_rows()}
    train = {scene_of({**r, "metadata": {"color": r["input"].split()[2]}}) for r in env.sft_rows()}
    assert val and train and not val & train
    assert all(in_validation(scene, split_seed) for scene, _ in env._problems_val)


def test_the_picture_shows_the_answer():
    env = small(seed=0, distractors=0.5)
    for row in env.val_rows()[:32]:
        board, colour = scene_of(row)
        assert board.count(colour) == int(row["ground_truth"]) == row["metadata"]["count"]
        assert row["prompt"] == f"<image>How many {colour} squares?"
        assert row["data_source"] == "shapes" and len(row["images"]) == 1


def test_answers_are_uniform_so_the_question_alone_scores_a_quarter():
    env = ShapesEnv(seed=0, num_train=2000, num_val=0, distractors=0.5)
    answers = [r["output"] for r in env.sft_rows()]
    counts = Counter(answers)
    assert sorted(counts) == ["0", "1", "2", "3"]
    assert max(counts.values()) / len(answers) < 0.29  # the best text-only guess
    by_question = Counter((r["input"], r["output"]) for r in env.sft_rows())
    for colour in ("red", "green", "blue"):  # also per question: the colour named says nothing of the count
        share = [by_question[(f"<image>How many {colour} squares?", str(k))] for k in range(4)]
        assert max(share) / sum(share) < 0.32


def test_picture_size_follows_the_grid():
    for grid, side in ((2, 56), (3, 84)):
        row = ShapesEnv(grid=grid, num_train=4, num_val=0).sft_rows()[0]
        assert PIL.open(io.BytesIO(row["images"][0])).size == (side, side)


@pytest.mark.parametrize(("response", "score"), [
    ("2", 1.0), (" 2\n", 1.0), ("2 ", 1.0),   # surrounding whitespace is stripped
    ("2 2", 0.0), ("22", 0.0), ("two", 0.0), ("2.", 0.0), ("The answer is 2", 0.0), ("", 0.0), ("3", 0.0),
])
def test_reward_is_an_exact_digit(response, score):
    env = small(seed=0)
    row = next(r for r in env.val_rows() if r["ground_truth"] == "2")
    assert env.compute_reward([row], [response]).scores.tolist() == [score]


def test_registered_and_kwargs_checked():
    env = build_env({"name": "shapes", "kwargs": {"num_train": 8, "num_val": 4}}, seed=1)
    assert isinstance(env, ShapesEnv) and len(env) == 8 and len(env.val_rows()) == 4
    with pytest.raises(ConfigError, match="max_cuont.*Did you mean.*max_count"):
        build_env({"name": "shapes", "kwargs": {"max_cuont": 2}})


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"colors": ["red"]}, "at least two different colours"),
    ({"colors": ["red", "pink"]}, "unknown: \\['pink'\\]"),
    ({"max_count": 5}, "max_count must be an int >= 1 and <= 4"),
    ({"grid": 0}, "grid must be an int >= 1"),
    ({"distractors": 1.5}, "distractors must be a probability"),
    ({"prompt_template": "How many {color}?"}, "must contain one <image> and \\{color\\}"),
    ({"prompt_template": "<image>How many {colour}?"}, "must contain one <image> and \\{color\\}"),
    ({"grid": 1, "max_count": 1, "distractors": 0.0, "split_seed": 4}, "too few scenes .* 0 asked squares"),
])
def test_bad_settings_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ShapesEnv(**{"num_train": 50, "num_val": 8, **kwargs})
