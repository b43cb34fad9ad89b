"""Multi-turn environments: the model writes, the environment answers (tool output, a user reply), until
the environment says the episode is done and scores it.

An episode of row `row`:

    prompt, state = env.start(row)                 # the first messages (text or chat messages)
    loop:
        model writes until a stop string (`rollout.stop`, e.g. "</calc>") or eos
        answer = env.step(state, model_text)       # Observation("...") or Done(reward)
        Observation: its text is appended (tokens the model reads but never trained on), the model continues
        Done: the episode ends with `answer.reward`

It ends as *truncated* (reward `env.truncated_reward(state)`, 0 by default) after `env.max_turns` model turns
that still wanted an answer, when the model's turn runs out of `rollout.max_new_tokens` without a stop
string, or when the episode's response part (model tokens + observation tokens, the prompt not counted)
would exceed `env.max_episode_tokens`.

This protocol sits next to the single-turn `Environment`, which stays as it is: the prompt source
(`get_batch`, `val_rows`, `state_dict`, `load_state_dict`, `__len__`) is the same, `compute_reward` is
replaced by the rewards `step` returns. `MultiTurnEnv` implements the prompt source over fixed rows.
A malformed tool call is the environment's to answer (an error observation, or Done with a low reward):
it is part of what the model learns, not a crash.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from verl.env.base import Environment, PromptEnv
from verl.env.episode import (  # the types the rollout reads
    Done,
    EpisodeEnv,
    Observation,
    env_name,
    truncated_reward,
)
from verl.errors import ConfigError


@runtime_checkable
class MultiTurnEnvironment(EpisodeEnv, Protocol):
    """What the trainer calls on a multi-turn environment."""

    max_turns: int  # model turns per episode
    max_episode_tokens: int  # tokens after the prompt (model + observations) per episode

    def start(self, row: Mapping[str, Any]) -> tuple[Any, Any]:
        """(first messages: a prompt string or a list of chat messages, the episode's state)."""
        ...

    def step(self, state: Any, model_text: str) -> Observation | Done:
        """Answer the model's latest turn."""
        ...

    def get_batch(self, batch_size: int) -> list[dict[str, Any]]: ...

    def val_rows(self) -> list[dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def is_multiturn(env: Environment | MultiTurnEnvironment) -> bool:
    """An environment is multi-turn when it has `start` and `step` (the trainer then runs episodes)."""
    return callable(getattr(env, "start", None)) and callable(getattr(env, "step", None))


def check_multiturn_env(env: MultiTurnEnvironment) -> None:
    """The episode limits must be usable before the first rollout, not after hours of training."""
    name = env_name(env)
    problems = []
    for attr, why in (("max_turns", "model turns per episode"),
                      ("max_episode_tokens", "tokens per episode after the prompt, model + observations")):
        value = getattr(env, attr, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{attr} ({why}) must be an int >= 1, got {value!r}")
    if problems:
        raise ConfigError(f"multi-turn environment {name}: " + "; ".join(problems)
                          + ". Fix: set them as attributes of the environment (MultiTurnEnv takes them as "
                          "constructor arguments, settable under env.kwargs).")


class MultiTurnEnv(PromptEnv):
    """Base for multi-turn environments over fixed train/val rows: subclass it and write `start` / `step`.

    The prompt order (epoch-wise seeded shuffle, resumable) is `PromptEnv`'s; episodes are scored by
    `step`, so no reward manager is needed. A subclass must define `step(state, model_text)`; the loader
    and the trainer refuse one that does not.
    """

    def __init__(
        self,
        train_rows: Sequence[Mapping[str, Any]],
        *,
        val_rows: Sequence[Mapping[str, Any]] = (),
        max_turns: int = 4,
        max_episode_tokens: int = 256,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__(train_rows, None, val_rows=val_rows, seed=seed, shuffle=shuffle)
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        check_multiturn_env(self)

    def start(self, row: Mapping[str, Any]) -> tuple[Any, Any]:
        """Default: the row's prompt, and the row itself as the state."""
        return row["prompt"], dict(row)


__all__ = ["Done", "MultiTurnEnv", "MultiTurnEnvironment", "Observation", "check_multiturn_env", "is_multiturn",
           "truncated_reward"]
