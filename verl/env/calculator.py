"""The `calculator` environment of the tool-use demo: products the tiny model cannot do in its head
("347*29="), and a calculator it may call mid-answer.

An episode: the model writes `<calc>347*29</calc>` (the turn ends at the stop string `</calc>`), the
environment answers ` <result>10063</result>`, the model writes its final answer ` 10063` and eos. The
reward is 1 when the final answer's last number equals the product, else `partial_credit` (default 0) times
the share of the product's digits it has in the right place: a denser signal for a model that calls the tool
right but copies the result wrong. A malformed call (an
expression that is not integers joined by + - *) is answered with ` <result>error</result>` and counted as
a tool error; it is the model's to recover from, not a crash.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from verl.env.multiturn import Done, MultiTurnEnv, Observation
from verl.errors import ConfigError
from verl.rewards.builtin import extract_number

DATA_SOURCE = "calculator"
_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_EXPR = re.compile(r"\s*-?\d+(\s*[-+*]\s*-?\d+)*\s*")


def digit_overlap(number: Any, answer: int) -> float:
    """Share of the answer's digits that the given number has in the same place (0 for no number)."""
    if number is None:
        return 0.0
    got, want = str(number), str(answer)
    return sum(a == b for a, b in zip(got, want, strict=False)) / max(len(got), len(want))


def evaluate_expression(expr: str) -> int | None:
    """The value of `a op b op c ...` with integers and + - * (usual precedence), or None if malformed."""
    if len(expr) > 64 or not _EXPR.fullmatch(expr):
        return None
    terms = re.findall(r"-?\d+|[-+*]", expr.replace(" ", ""))
    # Tokens alternate number, operator, number...; '-' directly after an operator belongs to the number.
    values: list[int] = []
    ops: list[str] = []
    expect_number = True
    for t in terms:
        if expect_number:
            values.append(int(t))
        else:
            if t.startswith("-") and len(t) > 1:  # "5-3" was read as 5 and -3
                ops.append("+")
                values.append(int(t))
                continue
            ops.append(t)
        expect_number = not expect_number
    if len(values) != len(ops) + 1:
        return None
    # Multiplication first, then left-to-right addition/subtraction.
    sums, signs = [values[0]], []
    for op, v in zip(ops, values[1:], strict=True):
        if op == "*":
            sums[-1] *= v
        else:
            sums.append(v)
            signs.append(op)
    total = sums[0]
    for op, v in zip(signs, sums[1:], strict=True):
        total = total + v if op == "+" else total - v
    return total


class CalculatorEnv(MultiTurnEnv):
    """`a*b=` with `a` of `digits_a` digits and `b` of `digits_b` digits; disjoint train and validation sets."""

    def __init__(self, seed: int = 0, num_train: int = 2000, num_val: int = 64, digits_a: int = 3,
                 digits_b: int = 2, max_turns: int = 3, max_episode_tokens: int = 64, partial_credit: float = 0.0,
                 shuffle: bool = True) -> None:
        if isinstance(partial_credit, bool) or not isinstance(partial_credit, (int, float)) or not (
                0.0 <= partial_credit < 1.0):
            raise ConfigError(f"env.kwargs.partial_credit must be in [0, 1), got {partial_credit!r}")
        self.partial_credit = float(partial_credit)
        for name, value in (("digits_a", digits_a), ("digits_b", digits_b), ("num_train", num_train),
                            ("num_val", num_val)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "num_val" else 1):
                raise ConfigError(f"env.kwargs.{name} must be a positive int, got {value!r}")
        lo_a, hi_a = 10 ** (digits_a - 1), 10**digits_a
        lo_b, hi_b = 10 ** (digits_b - 1), 10**digits_b
        total = (hi_a - lo_a) * (hi_b - lo_b)
        if num_train + num_val > total:
            raise ConfigError(f"env.kwargs asks for {num_train} + {num_val} problems, but {digits_a}- by {digits_b}"
                              f"-digit products have only {total}; lower num_train/num_val.")
        order = np.random.default_rng([seed, 2]).choice(total, size=num_train + num_val, replace=False)
        problems = [(lo_a + int(i) // (hi_b - lo_b), lo_b + int(i) % (hi_b - lo_b)) for i in order]
        self.val_problems = problems[:num_val]
        self.train_problems = problems[num_val:]
        super().__init__([self.problem_row(p) for p in self.train_problems],
                         val_rows=[self.problem_row(p) for p in self.val_problems],
                         max_turns=max_turns, max_episode_tokens=max_episode_tokens, seed=seed, shuffle=shuffle)

    @staticmethod
    def problem_row(problem: tuple[int, int]) -> dict[str, Any]:
        a, b = problem
        return {"prompt": f"{a}*{b}=", "ground_truth": str(a * b), "data_source": DATA_SOURCE,
                "metadata": {"a": a, "b": b}}

    def start(self, row: Mapping[str, Any]) -> tuple[Any, Any]:
        return row["prompt"], {"answer": int(row["ground_truth"]), "calls": 0, "correct_calls": 0, "correct": False}

    def step(self, state: dict[str, Any], model_text: str) -> Observation | Done:
        call = _CALL.search(model_text)
        if call is not None and model_text.rstrip().endswith("</calc>"):
            value = evaluate_expression(call.group(1))
            state["calls"] += 1
            if value is None:
                return Observation(" <result>error</result>", tool_call=True, tool_error=True)
            state["correct_calls"] += int(value == state["answer"])
            return Observation(f" <result>{value}</result>", tool_call=True)
        number = extract_number(model_text)
        correct = number is not None and number == state["answer"]
        state["correct"] = correct
        reward = 1.0 if correct else self.partial_credit * digit_overlap(number, state["answer"])
        return Done(reward=reward, info={"correct": correct, "tool_calls": state["calls"],
                                         "correct_calls": state["correct_calls"]})

    def truncated_reward(self, state: dict[str, Any]) -> float:
        return 0.0

    def demonstration_problems(self, count: int, seed: int) -> list[tuple[int, int]]:
        """`count` training problems for a warm start, as many of each product length as can be had (taken
        in turn): products of 3 by 2 digits have 4 digits one time in six, and a handful of random episodes
        taught a copy of the result that fits 5 digits only ("2316" answered as "23316"), which RL could
        not unlearn: every sample of such a problem got the same reward."""
        order = np.random.default_rng([seed, 3]).permutation(len(self.train_problems))
        by_length: dict[int, list[tuple[int, int]]] = {}
        for i in order:
            a, b = self.train_problems[int(i)]
            by_length.setdefault(len(str(a * b)), []).append((a, b))
        queues = [by_length[k] for k in sorted(by_length)]
        picked: list[tuple[int, int]] = []
        while len(picked) < min(count, len(self.train_problems)):
            for q in queues:
                if q and len(picked) < count:
                    picked.append(q.pop(0))
        return picked

    def formatted_episode(self, problem: tuple[int, int]) -> tuple[dict[str, Any], list[tuple[str, bool]]]:
        """(row, [(text, written by the model)]) of a correct tool-using episode, for the SFT warm start;
        the observation is this environment's own answer to the call."""
        a, b = problem
        call = f"<calc>{a}*{b}</calc>"
        row = self.problem_row(problem)
        observation = self.step(self.start(row)[1], call)  # a well-formed call: always an Observation
        return row, [(call, True), (observation.text, False), (f" {a * b}", True)]


__all__ = ["CalculatorEnv", "digit_overlap", "evaluate_expression"]
