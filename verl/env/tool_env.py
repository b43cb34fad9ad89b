"""Multi-turn tool use in the model's own chat format: tools declared as JSON schemas, calls parsed from the
model's turn in its template's format, results appended as the template's tool turn.

    class Calculator(ToolEnv):
        def score(self, row, answer):
            return float(extract_number(answer) == int(row["ground_truth"]))

    env = Calculator(rows, tools=[Tool("calculator", "Evaluate an expression.", schema, evaluate)],
                     tool_call_format="hermes")

An episode: the prompt is the row's messages rendered with `tools=` (the template lists them); the model's
turn ends at its end-of-turn token (eos; no `rollout.stop` needed); a turn with tool calls is answered
with their results as the template's tool turn (`verl.data.tool_template.ToolTurns`), a turn without one
is the final answer, scored by `score`. A call that cannot be parsed, names no known tool, has arguments
that do not fit the schema, or whose function raises is answered with an error result, counted in
`episode/tool_errors_mean`: the model's to learn from, never a crash.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from verl.data.tool_parsers import tool_call_format as format_named
from verl.data.tool_template import ToolTurns, prefix_preserving
from verl.env.multiturn import Done, MultiTurnEnv, Observation
from verl.env.tools import Tool, ToolResult, check_tools, run_tool
from verl.errors import ConfigError
from verl.rewards.builtin import extract_number
from verl.utils.tokenizer_protocol import Tokenizer


class ToolEnv(MultiTurnEnv):
    """Base for chat-template tool environments over fixed rows: give it tools (and a `score` for answers that
    are not a number to compare with the row's `ground_truth`)."""

    def __init__(self, train_rows: Sequence[Mapping[str, Any]], *, tools: Sequence[Tool],
                 tool_call_format: str = "hermes", val_rows: Sequence[Mapping[str, Any]] = (),
                 max_turns: int = 4, max_episode_tokens: int = 256, max_calls_per_turn: int = 4, seed: int = 0,
                 shuffle: bool = True) -> None:
        super().__init__(train_rows, val_rows=val_rows, max_turns=max_turns, max_episode_tokens=max_episode_tokens,
                         seed=seed, shuffle=shuffle)
        self.tools = check_tools(tools, type(self).__name__)
        if not self.tools:
            raise ConfigError(f"{type(self).__name__} declares no tools; pass tools=[Tool(...), ...]")
        self.tool_schemas = [t.schema for t in self.tools.values()]  # rendered into the prompt by the template
        self.format = format_named(tool_call_format)
        if isinstance(max_calls_per_turn, bool) or not isinstance(max_calls_per_turn, int) or max_calls_per_turn < 1:
            raise ConfigError(f"max_calls_per_turn must be an int >= 1, got {max_calls_per_turn!r}")
        self.max_calls_per_turn = max_calls_per_turn
        self.turns: ToolTurns | None = None

    def bind_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Learn the tool turn from the policy's chat template (refused here when it has no tool section); say
        when the template is not prefix-preserving (episodes are token-level, so they do not depend on it)."""
        self.turns = ToolTurns(tokenizer, self.tool_schemas, where=f"environment {type(self).__name__}")
        preserving, why = prefix_preserving(tokenizer, self.tool_schemas)
        if not preserving:
            warnings.warn(f"environment {type(self).__name__}: the chat template is not prefix-preserving: {why}",
                          stacklevel=2)

    def start(self, row: Mapping[str, Any]) -> tuple[Any, Any]:
        prompt = row["prompt"]
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return messages, {"row": dict(row), "tool_calls": 0, "tool_errors": 0}

    def step(self, state: dict[str, Any], model_text: str) -> Observation | Done:
        if self.turns is None:
            raise ConfigError(f"{type(self).__name__}.step before bind_tokenizer(tokenizer): the trainer binds the "
                              "policy's tokenizer when it builds the episodes; call it yourself outside a trainer")
        parsed = self.format.parse(model_text)
        if not parsed.wants_tools:
            return Done(self.score(state["row"], parsed.content), info=self.episode_info(state))
        results = [("error", ToolResult(f"error: {e}", error=True)) for e in parsed.errors]
        results += [(c.name, run_tool(self.tools, c)) for c in parsed.calls]
        extra = len(results) - self.max_calls_per_turn
        if extra > 0:
            results = results[: self.max_calls_per_turn]
            results[-1] = (results[-1][0], ToolResult(f"{results[-1][1].text} ({extra} more call(s) in this turn "
                                                      f"were not run: at most {self.max_calls_per_turn})", True))
        failed = any(r.error for _, r in results)
        state["tool_calls"] += len(results)
        state["tool_errors"] += sum(r.error for _, r in results)
        text = self.turns.render([(name, r.text) for name, r in results])
        return Observation(text, tool_call=True, tool_error=failed)

    def episode_info(self, state: dict[str, Any]) -> dict[str, Any]:
        """Numbers reported per episode (`episode/<key>` metrics)."""
        return {"calls": state["tool_calls"], "call_errors": state["tool_errors"]}

    def score(self, row: Mapping[str, Any], answer: str) -> float:
        """The final answer's reward (the model's last turn, its tool calls removed): by default 1 when its last
        number equals the row's `ground_truth`, else 0; override it for other tasks."""
        want = extract_number(str(row.get("ground_truth", "")))
        return float(want is not None and extract_number(answer) == want)


__all__ = ["ToolEnv"]
