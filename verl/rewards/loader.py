"""Find the callable a reward spec names: a built-in, a file, or a module.

User code is executed only from the file or module the user names; nothing is searched for on sys.path
beyond what `package.module:fn` asks for, and a file's directory is not added to sys.path.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl.errors import RewardError
from verl.rewards.builtin import BUILTIN_REWARDS
from verl.utils.suggest import did_you_mean
from verl.utils.user_code import exec_user_file, import_user_module, resolve_user_path

_FORMS = (
    "a built-in (" + ", ".join(sorted(BUILTIN_REWARDS)) + "), 'path/to/file.py:fn' "
    "(relative to the config file) or 'package.module:fn'"
)


def _looks_like_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _public_callables(namespace: Any) -> list[str]:
    return sorted(n for n, v in vars(namespace).items() if callable(v) and not n.startswith("_"))


def _get_attr(holder: Any, fn_name: str, where: str, what: str) -> Callable[..., Any]:
    obj: Any = holder
    for part in fn_name.split("."):
        if not hasattr(obj, part):
            available = _public_callables(holder)
            hint = did_you_mean(fn_name, available)
            raise RewardError(
                f"{where}: {what} has no function '{fn_name}'.{hint} Functions it defines: "
                f"{', '.join(available) or '(none)'}. Fix the name after ':' in the reward spec."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardError(
            f"{where}: '{fn_name}' in {what} is a {type(obj).__name__}, not a function; "
            "point the reward spec at a function."
        )
    return obj


def _load_file(path_text: str, fn_name: str, base_dir: Path | None, where: str) -> Callable[..., Any]:
    path = resolve_user_path(path_text, base_dir, what="reward file",
                             fail=lambda msg: RewardError(f"{where}: {msg} (the path before ':' in the spec)"))
    if not path.is_file():
        raise RewardError(f"{where}: reward file {path} is a folder; name a .py file before ':'.")
    module = exec_user_file(path, namespace="reward", label="reward file",
                            fail=lambda msg: RewardError(f"{where}: {msg}"))
    return _get_attr(module, fn_name, where, f"file {path}")


def _load_module(mod_path: str, fn_name: str, where: str) -> Callable[..., Any]:
    module = import_user_module(mod_path, example="path/to/file.py:fn", fail=lambda msg: RewardError(f"{where}: {msg}"))
    return _get_attr(module, fn_name, where, f"module '{mod_path}'")


def load_reward_function(
    name: str, *, base_dir: str | Path | None = None, where: str = "reward function"
) -> Callable[..., Any]:
    """Resolve a spec name to a callable, raising RewardError that names `where` and the fix."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    base = Path(base_dir) if base_dir is not None else None
    if ":" not in name:
        hint = did_you_mean(name, BUILTIN_REWARDS)
        raise RewardError(f"{where}: '{name}' is not a built-in reward.{hint} Use {_FORMS}.")
    target, fn_name = name.rsplit(":", 1)
    if not target or not fn_name:
        raise RewardError(
            f"{where}: '{name}' must have a file or module before ':' and a function name "
            f"after it. Use {_FORMS}."
        )
    if _looks_like_file(target):
        return _load_file(target, fn_name, base, where)
    return _load_module(target, fn_name, where)


def display_name(name: str) -> str:
    """A short label for logs: the built-in name, or the function name of 'target:fn'."""
    return name.rsplit(":", 1)[1] if ":" in name else name


__all__ = ["display_name", "load_reward_function"]
