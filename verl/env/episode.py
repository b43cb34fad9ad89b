"""What a multi-turn environment's `step` returns, as the episode rollout reads it (re-exported by
`verl.env`, where the protocol is described): `Observation` continues the episode, `Done` ends it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from verl.errors import EnvError


@dataclass(frozen=True)
class Observation:
    """The environment's answer that continues the episode: `text` is tokenised and appended as it is.

    `tool_call` / `tool_error` feed the metrics (tool calls per episode, failed tool calls)."""

    text: str
    tool_call: bool = False
    tool_error: bool = False


@dataclass(frozen=True)
class Done:
    """The episode is over; `reward` is its score (placed on the last model-written token)."""

    reward: float
    tool_call: bool = False
    tool_error: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class EpisodeEnv(Protocol):
    """What a multi-turn rollout calls on an environment (`verl.env.multiturn.MultiTurnEnvironment` is one):
    its limits, `start` and `step`; `truncated_reward(state)` too where it defines one."""

    max_turns: int  # model turns per episode
    max_episode_tokens: int  # tokens after the prompt (model + observations) per episode

    def start(self, row: Mapping[str, Any]) -> tuple[Any, Any]: ...

    def step(self, state: Any, model_text: str) -> Observation | Done: ...


def env_name(env: object) -> str:
    return type(env).__name__


def truncated_reward(env: EpisodeEnv, state: Any) -> float:
    """The reward of an episode that ended without Done: `env.truncated_reward(state)` if defined, else 0."""
    fn = getattr(env, "truncated_reward", None)
    return float(fn(state)) if callable(fn) else 0.0


def check_reward(env: EpisodeEnv, reward: Any, where: str) -> float:
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
        raise EnvError(f"environment {env_name(env)} returned Done(reward={reward!r}) {where}; the reward must "
                       "be a finite number. Fix step() of the environment.")
    return float(reward)


__all__ = ["Done", "EpisodeEnv", "Observation", "check_reward", "env_name", "truncated_reward"]
