"""The `shapes` environment of the vision demo: "<image>How many red squares?" over small generated pictures.

A picture is a `grid` x `grid` board of 28-pixel cells (one cell per image token of the tiny Qwen2.5-VL model:
14-pixel patches, 2x2 merge), each empty or holding one square of a colour, on a light background; the question
names one colour and the answer is how many squares of that colour there are, as a digit. The count is drawn
uniformly from 0..`max_count` before the picture is drawn, so the answer cannot be read from the question: a
model that does not look at the picture scores at most one in `max_count + 1`. The other cells hold squares of
the other colours or nothing, so counting all squares is not the answer either.

Everything is generated from the seed (no files): each picture is encoded as PNG bytes in its row, which the
data layer decodes when a batch is built (`verl.data.images`). Train and validation problems are disjoint as
scenes (which cell holds which colour, and the colour asked about), not only as pictures, so held-out accuracy
measures counting, not recall of a board seen in training (`in_validation`). Square size, place in its cell and
shade vary per picture. The reward is `exact_match` on the stripped response: " 3\\n" is right, "3 3" and
"three" are wrong.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from verl.env.base import PromptEnv
from verl.errors import ConfigError
from verl.rewards.manager import RewardManager
from verl.utils.pillow import require_pillow

DATA_SOURCE = "shapes"
CELL = 28  # pixels per grid cell: one merged image token of a 14-pixel-patch, 2x2-merge vision tower
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40), "green": (40, 165, 60), "blue": (40, 70, 215), "yellow": (225, 200, 30),
    "purple": (140, 50, 170), "orange": (240, 130, 20),
}
SHADE_JITTER = 25  # each channel of a square's colour moves by up to this much, per picture
DEFAULT_PROMPT = "<image>How many {color} squares?"
VAL_SHARE = 0.25  # of all scenes are validation scenes

Scene = tuple[tuple[int, ...], int]  # (colour index per cell, -1 for empty; the asked colour's index)


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise ConfigError(f"env.kwargs.{name} must be an int >= {minimum}{upper}, got {value!r}")
    return value


def draw_scene(rng: np.random.Generator, cells: int, num_colors: int, count: int, distractors: float = 0.5) -> Scene:
    """A board with `count` squares of the asked colour (drawn too); every other cell holds a square of one of
    the other colours with probability `distractors`, else nothing."""
    asked = int(rng.integers(num_colors))
    others = [c for c in range(num_colors) if c != asked]
    board = [others[int(rng.integers(len(others)))] if rng.random() < distractors else -1 for _ in range(cells)]
    for cell in rng.choice(cells, size=count, replace=False):
        board[int(cell)] = asked
    return tuple(board), asked


def render(board: Sequence[int], colors: Sequence[str], grid: int, seed: int) -> bytes:
    """The board as PNG bytes: one square per filled cell, its size, offset and shade drawn from `seed`."""
    Image = require_pillow("the shapes environment's pictures", ConfigError)
    from PIL import ImageDraw

    rng = np.random.default_rng(seed)
    light = int(rng.integers(225, 256))
    image = Image.new("RGB", (grid * CELL, grid * CELL), (light, light, light))
    draw = ImageDraw.Draw(image)
    for i, color in enumerate(board):
        if color < 0:
            continue
        size = int(rng.integers(14, 23))
        x = (i % grid) * CELL + int(rng.integers(0, CELL - size + 1))
        y = (i // grid) * CELL + int(rng.integers(0, CELL - size + 1))
        shade = tuple(int(np.clip(v + rng.integers(-SHADE_JITTER, SHADE_JITTER + 1), 0, 255))
                      for v in PALETTE[colors[color]])
        draw.rectangle([x, y, x + size - 1, y + size - 1], fill=shade)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def in_validation(scene: Scene, split_seed: int) -> bool:
    """Whether `scene` is a validation scene: a seeded hash sends `VAL_SHARE` of all scenes there, the same for
    every run with this `split_seed`, whatever else the run draws."""
    board, asked = scene
    return bool(np.random.default_rng([split_seed, 3, asked, *(c + 1 for c in board)]).random() < VAL_SHARE)


class ShapesEnv(PromptEnv):
    """Counting coloured squares in generated pictures, with disjoint train and validation scenes.

    `grid`: cells per side (the picture is 28*grid pixels square: 2 -> 4 image tokens, 3 -> 9). `colors`: names
    from `PALETTE`. `max_count`: answers run 0..max_count (at most grid*grid). A scene (which cell holds which
    colour, and the colour asked about) belongs to validation or training by `in_validation` (`split_seed`, else
    the run's `seed`); each problem draws its count uniformly, then a scene of its split, then a picture. A
    small grid has few scenes, so a scene may come back in its own split with another picture, never in the
    other split. `prompt_template` must contain `<image>` and `{color}`.
    """

    def __init__(
        self,
        seed: int = 0,
        num_train: int = 2048,
        num_val: int = 128,
        grid: int = 2,
        max_count: int = 3,
        colors: Sequence[str] = ("red", "green", "blue"),
        prompt_template: str = DEFAULT_PROMPT,
        shuffle: bool = True,
        reward_manager: RewardManager | None = None,
        split_seed: int | None = None,
        distractors: float = 0.0,
    ) -> None:
        _check_int("grid", grid, 1, 6)
        _check_int("max_count", max_count, 1, min(9, grid * grid))
        _check_int("num_train", num_train, 1)
        _check_int("num_val", num_val, 0)
        if split_seed is not None:
            _check_int("split_seed", split_seed, 0)
        colors = [colors] if isinstance(colors, str) else list(colors)
        unknown = [c for c in colors if c not in PALETTE]
        if len(colors) < 2 or unknown or len(set(colors)) != len(colors):
            raise ConfigError(f"env.kwargs.colors={colors} must name at least two different colours from "
                              f"{', '.join(PALETTE)}" + (f"; unknown: {unknown}" if unknown else ""))
        if prompt_template.count("<image>") != 1 or "{color}" not in prompt_template:
            raise ConfigError(f"env.kwargs.prompt_template={prompt_template!r} must contain one <image> and "
                              "{color} (e.g. '<image>How many {color} squares?')")
        try:
            prompt_template.format(color="red")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"env.kwargs.prompt_template cannot be formatted ({e!r}); it may use only "
                              "{color}") from None
        self.grid, self.max_count, self.colors, self.prompt_template = grid, max_count, tuple(colors), prompt_template
        if isinstance(distractors, bool) or not isinstance(distractors, (int, float)) or not 0 <= distractors <= 1:
            raise ConfigError(f"env.kwargs.distractors must be a probability in [0, 1], got {distractors!r}")
        self.distractors = float(distractors)
        self.split_seed = seed if split_seed is None else split_seed
        rng = np.random.default_rng([self.split_seed, 2])
        self._problems_val = self._draw(rng, num_val, validation=True)
        self._problems_train = self._draw(rng, num_train, validation=False)
        if reward_manager is None:
            reward_manager = RewardManager([{"name": "exact_match"}])
        super().__init__([self._row(p) for p in self._problems_train], reward_manager,
                         val_rows=[self._row(p) for p in self._problems_val], seed=seed, shuffle=shuffle)

    def _draw(self, rng: np.random.Generator, n: int, *, validation: bool) -> list[tuple[Scene, int]]:
        """`n` (scene, picture seed) pairs of scenes in the split, their counts uniform in 0..max_count."""
        out: list[tuple[Scene, int]] = []
        count, tries = int(rng.integers(self.max_count + 1)), 0
        while len(out) < n:
            scene = draw_scene(rng, self.grid * self.grid, len(self.colors), count, self.distractors)
            tries += 1
            if in_validation(scene, self.split_seed) == validation:  # the count stays: answers stay uniform
                out.append((scene, int(rng.integers(2**31))))
                count, tries = int(rng.integers(self.max_count + 1)), 0
            elif tries > 1000:
                raise ConfigError(f"env.kwargs: a {self.grid}x{self.grid} grid with {len(self.colors)} colours and "
                                  f"max_count={self.max_count} has too few scenes to draw {n} "
                                  f"{'validation' if validation else 'training'} problems with {count} asked squares "
                                  "from "
                                  f"(split_seed {self.split_seed} puts none of them there); raise distractors or "
                                  "grid, or try another split_seed")
        return out

    def _row(self, problem: tuple[Scene, int]) -> dict[str, Any]:
        (board, asked), picture = problem
        color = self.colors[asked]
        count = sum(c == asked for c in board)
        return {
            "prompt": self.prompt_template.format(color=color),
            "images": [render(board, self.colors, self.grid, picture)],
            "ground_truth": str(count),
            "data_source": DATA_SOURCE,
            "metadata": {"color": color, "count": count, "squares": sum(c >= 0 for c in board)},
        }

    def sft_rows(self) -> list[dict[str, Any]]:
        """{"input", "output", "images"} for every training problem, for a supervised warm start."""
        return [{"input": r["prompt"], "output": r["ground_truth"], "images": r["images"]}
                for r in (self._row(p) for p in self._problems_train)]


__all__ = ["CELL", "DATA_SOURCE", "PALETTE", "ShapesEnv", "draw_scene", "in_validation", "render"]
