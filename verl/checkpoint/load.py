"""Restoring a run's state from a checkpoint folder on any world size; DCP made quiet in one process and its errors one
line per rank."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from verl.checkpoint.dcp_io import (
    SafeFileSystemReader,
    apply_state_dict,
    read_metadata_safely,
    to_state_dict,
    top_level_keys,
)
from verl.checkpoint.layout import extra_file
from verl.checkpoint.manifest import DCP_DIR, read_manifest
from verl.errors import CheckpointError

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; one process is a supported case for us."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def describe_error(exc: BaseException) -> str:
    """One line per failing rank instead of DCP's multi-rank traceback dump."""
    if isinstance(exc, CheckpointException):
        parts = []
        for rank, (inner, _trace) in sorted(exc.failures.items()):
            if isinstance(inner, CheckpointError):
                parts.append(f"rank {rank}: {inner}")
            else:
                parts.append(f"rank {rank}: {type(inner).__name__}: {inner}")
        return "; ".join(parts) or "CheckpointException"
    return f"{type(exc).__name__}: {exc}"


def load_checkpoint(
    path: str | Path, *, app_state: dict[str, object], rank: int = 0, process_group: Any = None
) -> dict[str, Any]:
    """Restore ``app_state`` from a checkpoint folder; see :meth:`CheckpointManager.load`."""
    path = Path(path)
    manifest = read_manifest(path)
    md = read_metadata_safely(path / DCP_DIR / ".metadata")
    present = top_level_keys(md)
    state_dict = to_state_dict(app_state)
    missing = sorted(set(state_dict) - present)
    if missing:
        raise CheckpointError(
            f"{path}: holds no state for {', '.join(repr(k) for k in missing)} (it holds "
            f"{', '.join(sorted(present))}); the checkpoint is from a different kind of run (e.g. GRPO vs "
            "PPO with a critic). Resume from a matching checkpoint or trainer.resume=never."
        )
    try:
        with _quiet_single_process():
            dcp.load(
                state_dict,
                storage_reader=SafeFileSystemReader(str(path / DCP_DIR)),
                process_group=process_group,
                no_dist=process_group is None,
            )
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(
            f"{path / DCP_DIR}: loading model/optimizer state failed ({describe_error(exc)}); the "
            "model or optimizer differs from the one that was saved (architecture, parameter names, "
            "optimizer type)."
        ) from exc
    apply_state_dict(app_state, state_dict)
    own = path / extra_file(rank)
    if not own.is_file():
        own = path / extra_file(0)
        logger.warning(
            "%s was saved with world_size=%s; rank %d has no extra state of its own and uses rank 0's "
            "(its RNG stream is not the one it would have had).",
            path,
            manifest.get("world_size"),
            rank,
        )
    try:
        return torch.load(own, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(f"{own}: cannot be loaded with weights_only=True ({exc}).") from exc
