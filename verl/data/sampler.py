"""A seeded batch sampler whose position is part of the checkpoint.

The permutation of epoch e is a pure function of (seed, e), drawn from its own numpy Generator, so it
does not matter what else consumed global RNG state, and a run resumed from `state_dict()` sees exactly
the batches an uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from verl.errors import CheckpointError, DataError


class ResumableSampler:
    """Yields lists of row indices, epoch after epoch, forever; `len()` is batches per epoch."""

    def __init__(
        self, num_rows: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True
    ) -> None:
        if batch_size <= 0:
            raise DataError(f"batch size must be positive, got {batch_size}; check data.train_batch_size")
        if num_rows <= 0:
            raise DataError("the dataset has no rows; check data.train_files and the data report")
        if drop_last and num_rows < batch_size:
            raise DataError(
                f"the dataset has {num_rows} rows, fewer than one batch of {batch_size}; lower "
                "data.train_batch_size or add data"
            )
        self.num_rows, self.batch_size, self.seed = num_rows, batch_size, int(seed)
        self.shuffle, self.drop_last = shuffle, drop_last
        self._epoch = 0
        self._position = 0  # batches already handed out in the current epoch
        self._order: np.ndarray | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_rows // self.batch_size
        return -(-self.num_rows // self.batch_size)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed & 0xFFFFFFFFFFFFFFFF, epoch]).permutation(self.num_rows)

    def next_batch(self) -> list[int]:
        """The next batch of indices, moving to a freshly shuffled epoch when one ends."""
        if self._position >= len(self):
            self._epoch += 1
            self._position = 0
            self._order = None
        if self._order is None:
            self._order = self._permutation(self._epoch)
        start = self._position * self.batch_size
        batch = self._order[start : start + self.batch_size].tolist()
        self._position += 1
        return batch

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "num_rows": self.num_rows,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; refuses a state from a different dataset size, batch size, seed or shuffle setting."""
        for key in ("num_rows", "batch_size", "seed", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise CheckpointError(
                    f"sampler state in the checkpoint has {key}={state[key]!r} but this run has "
                    f"{key}={getattr(self, key)!r}; resuming would not reproduce the same batches. Use the "
                    "same data and data settings, or start a fresh run"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self):
            raise CheckpointError(f"sampler state epoch={epoch}, position={position} is out of range")
        self._epoch, self._position, self._order = epoch, position, None


__all__ = ["ResumableSampler"]
