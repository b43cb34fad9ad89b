"""The exception types verl raises for user mistakes.

Every message says what was wrong, where (file, line, key, rank) and what to do about it, so a user
never has to read a traceback from deep inside torch to find out that a config key has a typo.
"""

from __future__ import annotations


class VerlError(Exception):
    """Base class of every error verl raises on purpose."""


class ConfigError(VerlError):
    """The configuration is invalid (unknown key, bad value, impossible combination)."""


class DataError(VerlError):
    """A dataset file or row cannot be used as it is."""


class ModelError(VerlError):
    """A model or tokenizer cannot be loaded, or they do not match each other."""


class DeviceMappingError(VerlError):
    """The mapping of roles (actor, critic, ref, reward) onto devices cannot work."""


class CheckpointError(VerlError):
    """A checkpoint is missing, incomplete, corrupt or cannot be written."""


class RewardError(VerlError):
    """A reward function raised, returned something unusable, or cannot be found."""


class DistributedError(VerlError):
    """A collective timed out or the process groups disagree."""


class RolloutError(VerlError):
    """The rollout engine samples from another policy than the one being trained."""


class EnvError(VerlError):
    """A (multi-turn) environment raised or answered something unusable during an episode."""


class SandboxError(VerlError):
    """Model-written code cannot be run with the isolation asked for (the host lacks it, or bad limits)."""


def install_hint(package: str, extra: str | None = None) -> str:
    """How to install an optional dependency, in a form that works.

    `verl` on the package index is a different project, so `pip install 'verl[extra]'` would replace this
    install; the hint names the package itself, and the extra of a source checkout.
    """
    hint = f"pip install {package}"
    return hint + (f" (or, in a verl checkout: pip install -e '.[{extra}]')" if extra else "")


__all__ = [
    "install_hint",
    "VerlError",
    "ConfigError",
    "DataError",
    "ModelError",
    "DeviceMappingError",
    "CheckpointError",
    "RewardError",
    "DistributedError",
    "RolloutError",
    "EnvError",
    "SandboxError",
]
