"""The built-in `arithmetic` environment the demo trains on: short "12+7=" problems scored by numeric_match.

Problems are generated, not downloaded, so the demo runs offline; train and validation sets are disjoint
so validation accuracy measures generalisation rather than memorisation. Prompts are kept short because
the demo model is tiny.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from verl.env.base import PromptEnv
from verl.errors import ConfigError
from verl.rewards.builtin import extract_number
from verl.rewards.manager import RewardManager

DATA_SOURCE = "arithmetic"
_OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"env.kwargs.{name} must be an int >= {minimum}, got {value!r}")
    return value


class ArithmeticEnv(PromptEnv):
    """Integer arithmetic problems with disjoint train and validation sets.

    Every distinct (a, op, b) with 0 <= a <= max_operand and 0 <= b <= max_second_operand (default:
    max_operand) is a candidate; a seeded shuffle picks
    `num_val` validation problems first and then `num_train` training problems (None = all the rest).
    With allow_negative=False, subtraction only uses a >= b so answers stay non-negative.
    `split_seed` seeds that pick instead of the run's seed (`trainer.seed`, which still orders the prompts):
    RL runs with other seeds then validate on the same held-out problems, none of which a shared warm start
    trained on.
    """

    def __init__(
        self,
        seed: int = 0,
        num_train: int | None = None,
        num_val: int = 64,
        max_operand: int = 20,
        max_second_operand: int | None = None,
        ops: Sequence[str] = ("+", "-"),
        allow_negative: bool = False,
        prompt_template: str = "{a}{op}{b}=",
        answer_template: str = "{answer}",
        shuffle: bool = True,
        reward_manager: RewardManager | None = None,
        split_seed: int | None = None,
    ) -> None:
        _check_int("max_operand", max_operand, 1)
        if split_seed is not None:
            _check_int("split_seed", split_seed, 0)
        if max_second_operand is None:
            max_second_operand = max_operand
        _check_int("max_second_operand", max_second_operand, 1)
        _check_int("num_val", num_val, 0)
        if num_train is not None:
            _check_int("num_train", num_train, 1)
        if isinstance(ops, str):
            ops = list(ops)
        ops = tuple(ops)
        bad = [o for o in ops if o not in _OPS]
        if not ops or bad:
            raise ConfigError(
                f"env.kwargs.ops={list(ops)} has unsupported operators {bad}; use a non-empty "
                f"list drawn from {list(_OPS)}"
            )
        if len(set(ops)) != len(ops):
            raise ConfigError(f"env.kwargs.ops={list(ops)} lists an operator twice; list each once")
        try:
            prompt_template.format(a=1, op="+", b=2)
            sample_answer = answer_template.format(answer=-123)
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"env.kwargs.prompt_template/answer_template cannot be formatted ({e!r}); the "
                "prompt may use {a}, {op}, {b} and the answer {answer}"
            ) from None
        if extract_number(sample_answer) != -123:
            raise ConfigError(
                f"env.kwargs.answer_template={answer_template!r} gives {sample_answer!r}, whose "
                "last number is not the answer, so numeric_match would mis-score it; put "
                "{answer} last (e.g. '{answer}' or '#### {answer}')"
            )

        problems = [
            (a, op, b)
            for op in ops
            for a in range(max_operand + 1)
            for b in range(max_second_operand + 1)
            if allow_negative or op != "-" or a >= b
        ]
        order = np.random.default_rng([seed if split_seed is None else split_seed, 1]).permutation(len(problems))
        wanted = num_val + (num_train if num_train is not None else 1)
        if wanted > len(problems):
            raise ConfigError(
                f"env.kwargs asks for num_val={num_val} + num_train={num_train if num_train is not None else '>=1'} "
                f"problems, but max_operand={max_operand} with ops={list(ops)} has only {len(problems)} distinct "
                "ones; raise max_operand (or add ops) or lower num_train/num_val"
            )
        val_idx = order[:num_val]
        train_idx = order[num_val:] if num_train is None else order[num_val : num_val + num_train]

        self.prompt_template = prompt_template
        self.answer_template = answer_template
        self._problems_train = [problems[int(i)] for i in train_idx]
        self._problems_val = [problems[int(i)] for i in val_idx]
        if reward_manager is None:
            reward_manager = RewardManager([{"name": "numeric_match", "kwargs": {"mode": "flexible"}}])
        super().__init__(
            [self._row(p) for p in self._problems_train],
            reward_manager,
            val_rows=[self._row(p) for p in self._problems_val],
            seed=seed,
            shuffle=shuffle,
        )

    def _row(self, problem: tuple[int, str, int]) -> dict[str, Any]:
        a, op, b = problem
        return {
            "prompt": self.prompt_template.format(a=a, op=op, b=b),
            "ground_truth": str(_OPS[op](a, b)),
            "data_source": DATA_SOURCE,
            "metadata": {},
        }

    def sft_pairs(self) -> list[tuple[str, str]]:
        """(prompt, answer text) for every training problem, for a supervised warm start."""
        out = []
        for a, op, b in self._problems_train:
            answer = self.answer_template.format(answer=_OPS[op](a, b))
            out.append((self.prompt_template.format(a=a, op=op, b=b), answer))
        return out


def arithmetic_sft_pairs(num_pairs: int | None = None, **env_kwargs: Any) -> list[tuple[str, str]]:
    """SFT pairs drawn only from the training split of `ArithmeticEnv(**env_kwargs)`.

    Pass the same kwargs as the RL environment so the warm start never sees a validation problem.
    """
    pairs = ArithmeticEnv(**env_kwargs).sft_pairs()
    if num_pairs is not None:
        _check_int("num_pairs", num_pairs, 1)
        pairs = pairs[:num_pairs]
    return pairs


__all__ = ["ArithmeticEnv", "DATA_SOURCE", "arithmetic_sft_pairs"]
