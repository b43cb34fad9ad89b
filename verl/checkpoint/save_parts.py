"""What a save hands over and back: the extra state as bytes proven loadable, and the handle of a save in flight."""

from __future__ import annotations

import io
import re
from concurrent.futures import Future
from pathlib import Path

import torch

from verl.errors import CheckpointError, VerlError


def serialize_extra(extra: dict[str, object]) -> bytes:
    """``torch.save`` bytes of ``extra``, proven to load with ``weights_only=True`` before we rely on it.

    Failing here, at save time, beats finding out at resume time that a checkpoint cannot be loaded.
    """
    if not isinstance(extra, dict):
        raise CheckpointError(f"`extra` must be a dict, got {type(extra).__name__}.")
    buf = io.BytesIO()
    torch.save(extra, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        reason = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        why = f"it holds {reason.group(1)}" if reason else f"{type(exc).__name__}"
        bad = "?"
        for key, value in extra.items():
            b = io.BytesIO()
            try:
                torch.save(value, b)
                torch.load(io.BytesIO(b.getvalue()), weights_only=True)
            except Exception:
                bad = key
                break
        raise CheckpointError(
            f"extra['{bad}'] cannot be loaded back with torch.load(weights_only=True) ({why}); store only "
            "tensors, numbers, strings, lists, tuples and dicts there (e.g. a numpy array as a tensor, "
            "a config as YAML text)."
        ) from exc
    return data


class CheckpointHandle:
    """A save in flight (async) or done (sync). ``result()`` returns the committed path or raises."""

    def __init__(self, step: int, path: Path, future: Future | None = None) -> None:
        self.step = step
        self.path = path
        self._future = future

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def result(self, timeout: float | None = None) -> Path:
        if self._future is not None:
            try:
                self._future.result(timeout=timeout)
            except VerlError:
                raise
            except Exception as exc:
                raise CheckpointError(
                    f"checkpoint for step {self.step} ({self.path}) failed in the background: "
                    f"{type(exc).__name__}: {exc}. It was not committed; `latest` still points to the "
                    "previous checkpoint."
                ) from exc
        return self.path
