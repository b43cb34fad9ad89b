"""The exception types verl raises for user mistakes.

Every message says what was wrong, where (file, line, key, rank) and what to do about it, so a user
never has to read a traceback from deep inside torch to find out that a config key has a typo.
"""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path


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


class ViewError(VerlError):
    """`verl view` cannot show a run as asked (no such folder, plotly missing, a query it cannot answer)."""


class DiskFullError(VerlError):
    """A write failed because the disk (or the user's quota) is full: what failed, the last verified
    checkpoint and the command to resume, in one line."""


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def disk_full_cause(exc: BaseException | None) -> OSError | None:
    """The OSError with ENOSPC/EDQUOT behind `exc` (itself, its cause or context chain, or a failure that a
    torch.distributed.checkpoint CheckpointException carries per rank), or None."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return e
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f
                     for f in failures.values() if isinstance(f, (tuple, BaseException))]
        todo += [e.__cause__, e.__context__]
    return None


def _checkpoint_files_intact(folder: Path) -> bool:
    """Cheap stand-in for verl.checkpoint.verify(deep=False), which this layer cannot import: the manifest
    parses and lists every file at its size. (Every checkpoint was verified in full before its commit.)"""
    try:
        manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
        files = manifest["files"]
        return all((folder / rel).stat().st_size == info["size"] for rel, info in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def last_verified_checkpoint(run_dir: str | Path | None) -> Path | None:
    """The checkpoint a `trainer.resume=auto` would continue from: the one `latest` names, else the newest
    `step_<N>` folder, whose manifest lists every file at its size."""
    if run_dir is None:
        return None
    root = Path(run_dir) / "checkpoints"
    try:
        latest = (root / "latest").read_text(encoding="utf-8").strip()
        steps = sorted((p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"step_\d+", p.name)),
                       key=lambda p: int(p.name[5:]), reverse=True)
    except OSError:
        latest, steps = "", []
        if not root.is_dir():
            return None
    steps.sort(key=lambda p: p.name != latest)  # `latest` first, then the rest newest first
    return next((p for p in steps if _checkpoint_files_intact(p)), None)


def disk_full_error(cause: OSError, what: str, run_dir: str | Path | None,
                    last_checkpoint: Path | None | str = "find") -> DiskFullError:
    """The one-line error for a write that ran out of space. `what`: the write that failed (e.g. "saving
    checkpoint step 7"); `last_checkpoint`: the newest good checkpoint, looked up under `run_dir` by default."""
    where = f" ({cause.filename})" if cause.filename and str(cause.filename) not in what else ""
    reason = "disk quota exceeded" if cause.errno == errno.EDQUOT else "no space left on device"
    last = last_verified_checkpoint(run_dir) if last_checkpoint == "find" else last_checkpoint
    resume = (f"last verified checkpoint: {last}" if last is not None
              else "no verified checkpoint yet (a resume starts from step 0)")
    return DiskFullError(f"{what}{where} failed: {reason}. Nothing half-written is used; {resume}. Fix: free space "
                         "on that disk (or lower checkpoint.save_total_limit), then resume with "
                         "`verl train CONFIG trainer.resume=auto` (the same command: auto is the default).")


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
    "DiskFullError",
    "ViewError",
    "disk_full_cause",
    "disk_full_error",
    "last_verified_checkpoint",
]
