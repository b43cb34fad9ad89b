"""Load a user's environment class from the file or module that `env.name` names.

`env.name: path/to/my_env.py:MyEnv` (relative to the config file) or `env.name: my_pkg.envs:MyEnv` builds
`MyEnv(**env.kwargs)`. As with reward functions, code runs only from the file or module the user names;
nothing is searched for, and the file's directory is not put on sys.path. The class is checked for every
method the trainer calls before it is constructed, so a missing method fails at start-up with the file,
the class and the method's name, not hours later at the first validation or checkpoint.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from verl.errors import ConfigError, VerlError
from verl.utils.suggest import did_you_mean
from verl.utils.user_code import exec_user_file, import_user_module, resolve_user_path

# What the trainer and `verl check` call on an environment, and why (shown when one is missing).
REQUIRED_METHODS: dict[str, str] = {
    "get_batch": "get_batch(batch_size) -> list of rows, the next training prompts",
    "compute_reward": "compute_reward(rows, responses) -> RewardResult, the score of each response",
    "val_rows": "val_rows() -> list of rows, the validation prompts (may be empty)",
    "state_dict": "state_dict() -> dict, where the prompt order stands (saved in checkpoints)",
    "load_state_dict": "load_state_dict(state), restores it on resume",
    "__len__": "__len__() -> int, the number of training prompts (printed at start and by verl check)",
}

# What a multi-turn environment (verl.env.multiturn) has instead of compute_reward.
MULTITURN_METHODS: dict[str, str] = {
    "start": "start(row) -> (first messages, episode state)",
    "step": "step(state, model_text) -> Observation(text) to continue or Done(reward) to end the episode",
}

# Parameters the run fills in itself when the constructor accepts them (from trainer.seed, data.shuffle).
RUN_PROVIDED = ("seed", "shuffle")


def is_user_env_spec(name: str) -> bool:
    """'file.py:Class' or 'package.module:Class' (built-in names never contain ':')."""
    return ":" in name


def _looks_like_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _import_file(path_text: str, base_dir: Path | None, spec: str) -> tuple[ModuleType, str]:
    path = resolve_user_path(path_text, base_dir, what="environment file",
                             fail=lambda msg: ConfigError(f"env.name={spec!r}: {msg} (the path before ':')"))
    if not path.is_file():
        raise ConfigError(f"env.name={spec!r}: environment file {path} is a folder; name a .py file before ':'.")
    module = exec_user_file(path, namespace="env", label="environment file",
                            fail=lambda msg: ConfigError(f"env.name={spec!r}: {msg}"))
    return module, f"file {path}"


def _import_module(mod_path: str, spec: str) -> tuple[ModuleType, str]:
    module = import_user_module(mod_path, example="path/to/file.py:Class",
                                fail=lambda msg: ConfigError(f"env.name={spec!r}: {msg}"))
    return module, f"module '{mod_path}'"


def _wants_multiturn(cls: type) -> bool:
    from verl.env.multiturn import MultiTurnEnv

    return issubclass(cls, MultiTurnEnv) or any(callable(getattr(cls, m, None)) for m in MULTITURN_METHODS)


def required_methods(cls: type) -> dict[str, str]:
    """The methods the trainer calls on `cls`: multi-turn environments score in `step`, not `compute_reward`."""
    if not _wants_multiturn(cls):
        return REQUIRED_METHODS
    return {k: v for k, v in REQUIRED_METHODS.items() if k != "compute_reward"} | MULTITURN_METHODS


def _missing_methods(cls: type) -> list[str]:
    return [m for m in required_methods(cls) if not callable(getattr(cls, m, None))]


def load_env_class(spec: str, *, base_dir: str | Path | None = None) -> type:
    """Resolve 'file.py:Class' / 'package.module:Class' to a class that has every required method."""
    target, _, class_name = spec.rpartition(":")
    if not target or not class_name:
        raise ConfigError(
            f"env.name={spec!r} must be 'path/to/file.py:Class' or 'package.module:Class': a file or module "
            "before ':' and a class name after it."
        )
    base = Path(base_dir) if base_dir is not None else None
    module, where = _import_file(target, base, spec) if _looks_like_file(target) else _import_module(target, spec)
    cls = getattr(module, class_name, None)
    if cls is None:
        classes = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and not n.startswith("_"))
        hint = did_you_mean(class_name, classes)
        raise ConfigError(
            f"env.name={spec!r}: {where} has no class '{class_name}'.{hint} Classes it defines: "
            f"{', '.join(classes) or '(none)'}. Fix the name after ':'."
        )
    if not inspect.isclass(cls):
        raise ConfigError(
            f"env.name={spec!r}: '{class_name}' in {where} is a {type(cls).__name__}, not a class; point "
            "env.name at an environment class."
        )
    missing = _missing_methods(cls)
    if missing:
        needed = "; ".join(required_methods(cls)[m] for m in missing)
        raise ConfigError(
            f"env.name={spec!r}: class '{class_name}' in {where} lacks the method(s) "
            f"{', '.join(missing)}, which the trainer calls. Add: {needed}. "
            "(Subclassing verl.env.PromptEnv, or verl.env.MultiTurnEnv for tool use, provides the prompt-source "
            "methods for a fixed list of prompt rows.)"
        )
    return cls


def build_user_env(
    spec: str,
    kwargs: Mapping[str, Any],
    *,
    base_dir: str | Path | None = None,
    seed: int = 0,
    shuffle: bool = True,
) -> Any:
    """`Class(**env.kwargs)`, plus `seed`/`shuffle` from the run when the constructor takes them."""
    cls = load_env_class(spec, base_dir=base_dir)
    class_name = spec.rpartition(":")[2]
    signature = inspect.signature(cls)
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key in kwargs:
        if key in RUN_PROVIDED and key in params:
            raise ConfigError(
                f"env.kwargs.{key} is set by the run itself for env '{spec}' (trainer.seed / data.shuffle); "
                "remove it from env.kwargs."
            )
        if key not in params and not takes_any:
            allowed = sorted(p for p in params if p not in RUN_PROVIDED)
            hint = did_you_mean(key, allowed)
            raise ConfigError(
                f"env.kwargs.{key} is not a parameter of {class_name}.__init__.{hint} Parameters: "
                f"{', '.join(allowed) or '(none)'}."
            )
    call = dict(kwargs)
    if "seed" in params:
        call["seed"] = seed
    if "shuffle" in params:
        call["shuffle"] = shuffle
    try:
        signature.bind(**call)
    except TypeError as e:
        raise ConfigError(
            f"env.name={spec!r}: {class_name}(**env.kwargs) cannot be called with {sorted(kwargs)}: {e}. "
            "Set the missing constructor arguments under env.kwargs."
        ) from None
    try:
        return cls(**call)
    except VerlError:
        raise
    except Exception as e:
        raise ConfigError(
            f"env.name={spec!r}: {class_name}(**env.kwargs) raised {type(e).__name__}: {e}. Fix the "
            "constructor or the values under env.kwargs."
        ) from e


__all__ = ["MULTITURN_METHODS", "REQUIRED_METHODS", "required_methods", "build_user_env", "is_user_env_spec",
           "load_env_class"]
