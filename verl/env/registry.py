"""Build an environment from the `env` config section by name.

`env.name: arithmetic` is the offline demo task (`shapes`: the vision demo's pictures); `env.name: null` (or
`dataset`) trains on the rows the data layer read from `data.train_files`, scored by `reward.functions`.
Projects can add their own names with `register_env`, or point `env.name` at a class: `path/to/file.py:Class`
or `package.module:Class` (built with `env.kwargs`; see `verl.env.loader`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl.env.arithmetic import ArithmeticEnv
from verl.env.base import Environment
from verl.env.calculator import CalculatorEnv
from verl.env.dataset import DatasetEnv
from verl.env.loader import build_user_env, is_user_env_spec
from verl.env.multiturn import check_multiturn_env, is_multiturn
from verl.env.shapes import ShapesEnv
from verl.errors import ConfigError
from verl.rewards.manager import RewardManager
from verl.utils.suggest import did_you_mean


@dataclass(frozen=True)
class EnvBuildContext:
    """What the run provides to an environment factory besides its own `env.kwargs`."""

    seed: int = 0
    shuffle: bool = True
    reward_functions: Sequence[Any] = ()
    base_dir: str | Path | None = None
    train_rows: Sequence[Mapping[str, Any]] | None = None
    val_rows: Sequence[Mapping[str, Any]] | None = None
    rewards_optional: bool = False  # no reward.functions is fine: an agent returns its episodes' rewards


EnvFactory = Callable[..., Environment]  # factory(ctx: EnvBuildContext, **env_kwargs)


def _bind_kwargs(
    name: str, target: Callable[..., Any], kwargs: Mapping[str, Any], reserved: set[str]
) -> None:
    params = inspect.signature(target).parameters
    allowed = sorted(p for p in params if p not in reserved and p != "self")
    for key in kwargs:
        if key in reserved:
            raise ConfigError(
                f"env.kwargs.{key} is set by the run itself for env '{name}' (from the top-level "
                "config); remove it from env.kwargs."
            )
        if key not in params:
            hint = did_you_mean(key, allowed)
            raise ConfigError(
                f"env.kwargs.{key} is not an option of env '{name}'.{hint} Options: {', '.join(allowed)}."
            )


def _build_arithmetic(ctx: EnvBuildContext, **kwargs: Any) -> Environment:
    _bind_kwargs("arithmetic", ArithmeticEnv.__init__, kwargs, {"seed", "shuffle", "reward_manager"})
    manager = (RewardManager(ctx.reward_functions, base_dir=ctx.base_dir, required=not ctx.rewards_optional)
               if ctx.reward_functions else None)
    return ArithmeticEnv(seed=ctx.seed, shuffle=ctx.shuffle, reward_manager=manager, **kwargs)


def _build_dataset(ctx: EnvBuildContext, **kwargs: Any) -> Environment:
    if kwargs:
        raise ConfigError(
            f"env.kwargs {sorted(kwargs)} are not used by the dataset environment (env.name: "
            "null); remove them, or set env.name to a built-in environment."
        )
    if ctx.train_rows is None:
        raise ConfigError(
            "env.name is null, so training prompts come from data.train_files, but no rows "
            "were given; set data.train_files, or use env.name: arithmetic for the demo task."
        )
    manager = RewardManager(ctx.reward_functions, base_dir=ctx.base_dir, required=not ctx.rewards_optional)
    return DatasetEnv(
        ctx.train_rows, manager, val_rows=ctx.val_rows or (), seed=ctx.seed, shuffle=ctx.shuffle
    )


def _build_calculator(ctx: EnvBuildContext, **kwargs: Any) -> Environment:
    _bind_kwargs("calculator", CalculatorEnv.__init__, kwargs, {"seed", "shuffle"})
    return CalculatorEnv(seed=ctx.seed, shuffle=ctx.shuffle, **kwargs)


def _build_shapes(ctx: EnvBuildContext, **kwargs: Any) -> Environment:
    _bind_kwargs("shapes", ShapesEnv.__init__, kwargs, {"seed", "shuffle", "reward_manager"})
    manager = (RewardManager(ctx.reward_functions, base_dir=ctx.base_dir, required=not ctx.rewards_optional)
               if ctx.reward_functions else None)
    return ShapesEnv(seed=ctx.seed, shuffle=ctx.shuffle, reward_manager=manager, **kwargs)


_REGISTRY: dict[str, EnvFactory] = {"arithmetic": _build_arithmetic, "calculator": _build_calculator,
                                    "dataset": _build_dataset, "shapes": _build_shapes}
# Built-ins whose factories make their own prompts and never read `ctx.train_rows` / `ctx.val_rows`.
SELF_CONTAINED_ENVS: tuple[str, ...] = ("arithmetic", "calculator", "shapes")


def register_env(name: str, factory: EnvFactory) -> None:
    """Make `env.name: <name>` build `factory(ctx: EnvBuildContext, **env.kwargs)`."""
    if name in _REGISTRY:
        raise ConfigError(f"environment name '{name}' is already registered; pick another name.")
    if is_user_env_spec(name):
        raise ConfigError(f"environment name '{name}' contains ':', which env.name reads as 'file.py:Class'; "
                          "pick a name without ':'.")
    _REGISTRY[name] = factory


def available_envs() -> list[str]:
    return sorted(_REGISTRY)


def build_env(
    config: str | Mapping[str, Any] | Any | None = None,
    *,
    reward_functions: Sequence[Any] = (),
    train_rows: Sequence[Mapping[str, Any]] | None = None,
    val_rows: Sequence[Mapping[str, Any]] | None = None,
    base_dir: str | Path | None = None,
    seed: int = 0,
    shuffle: bool = True,
    rewards_optional: bool = False,
    **kwargs: Any,
) -> Environment:
    """Build an environment from a name, a mapping {name, kwargs}, or an object with .name/.kwargs.

    Extra keyword arguments are merged over the config's kwargs (handy from Python:
    `build_env("arithmetic", num_val=8)`). `reward_functions` are `reward.functions` specs; the arithmetic
    env uses numeric_match when none are given; data rows may have none when `rewards_optional` (an agent
    returns the rewards).
    """
    if config is None or isinstance(config, str):
        name, env_kwargs = config, {}
    elif isinstance(config, Mapping):
        extra = set(config) - {"name", "kwargs"}
        if extra:
            raise ConfigError(
                f"env config has unknown keys {sorted(extra)}; it takes 'name' and 'kwargs' "
                "(put environment options under env.kwargs)."
            )
        name, env_kwargs = config.get("name"), dict(config.get("kwargs") or {})
    elif hasattr(config, "name"):
        name, env_kwargs = config.name, dict(getattr(config, "kwargs", None) or {})
    else:
        raise ConfigError(
            f"env config must be a name, a mapping or an env section, got {type(config).__name__}"
        )
    env_kwargs.update(kwargs)
    name = name or "dataset"
    if is_user_env_spec(name):
        env = build_user_env(name, env_kwargs, base_dir=base_dir, seed=seed, shuffle=shuffle)
        if is_multiturn(env):  # `verl check` and the trainer's start-up see bad episode limits
            check_multiturn_env(env)
        return env
    if name not in _REGISTRY:
        hint = did_you_mean(name, _REGISTRY)
        raise ConfigError(
            f"env.name '{name}' is not a known environment.{hint} Known: "
            f"{', '.join(available_envs())}, your own class as 'path/to/file.py:Class', or null to train "
            "on data.train_files."
        )
    ctx = EnvBuildContext(
        seed=seed,
        shuffle=shuffle,
        reward_functions=tuple(reward_functions),
        base_dir=base_dir,
        train_rows=train_rows,
        val_rows=val_rows,
        rewards_optional=rewards_optional,
    )
    return _REGISTRY[name](ctx, **env_kwargs)


__all__ = ["EnvBuildContext", "SELF_CONTAINED_ENVS", "available_envs", "build_env", "register_env"]
