"""The one resumable shuffled order over dataset rows, and the batch sampler built on it.

The permutation of epoch e is a pure function of (seed, stream, e), drawn from its own numpy Generator, so
it does not matter what else consumed global RNG state, and a run resumed from `state_dict()` sees exactly
the rows an uninterrupted run would have. The RL environments' prompt order, the SFT/DPO row stream and
the batch sampler all walk a `ResumableOrder`, so there is one state format and one set of resume checks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from verl.errors import CheckpointError, DataError

_SEED_MASK = 0xFFFFFFFFFFFFFFFF  # numpy seeds must be non-negative; a negative config seed still works
_IDENTITY_KEYS = ("seed", "shuffle", "num_rows")


class ResumableOrder:
    """Row indices epoch after epoch, each epoch a fresh seeded permutation; position is checkpointed.

    ``stream`` separates orders that share a seed (the RL prompt order uses ``(0,)``) so two consumers of
    one seed do not see the same permutation. ``what`` names the owner in resume errors.
    """

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True, *, stream: tuple[int, ...] = (),
                 what: str = "sampler") -> None:
        self.num_rows, self.seed, self.shuffle = int(num_rows), int(seed), bool(shuffle)
        self.stream, self.what = tuple(int(s) for s in stream), what
        self._epoch = 0
        self._position = 0  # rows already handed out in the current epoch
        self._perm_epoch = -1
        self._perm: np.ndarray = np.arange(0)

    @property
    def epoch(self) -> int:
        """The epoch the next row comes from (moved on lazily, when a row past the end is asked for)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Rows of the current epoch already handed out."""
        return self._position

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of `epoch` (the last one is cached: consumers read one epoch at a time)."""
        if self._perm_epoch != epoch:
            if self.shuffle:
                key = [self.seed & _SEED_MASK, *self.stream, epoch]
                self._perm = np.random.default_rng(key).permutation(self.num_rows)
            else:
                self._perm = np.arange(self.num_rows)
            self._perm_epoch = epoch
        return self._perm

    def take(self, count: int) -> list[int]:
        """The next `count` indices; a take that crosses an epoch end continues in the next epoch's order."""
        out: list[int] = []
        while len(out) < count:
            out += self.take_from_epoch(count - len(out), self.num_rows)
        return out

    def take_from_epoch(self, count: int, rows_per_epoch: int) -> list[int]:
        """Up to `count` indices from one epoch that only uses its first `rows_per_epoch` rows.

        When the epoch's used rows are exhausted the next epoch starts first; the result is short only at
        the end of an epoch (a sampler's last batch without drop_last).
        """
        if self._position >= rows_per_epoch:
            self._epoch += 1
            self._position = 0
        start = self._position
        stop = min(start + count, rows_per_epoch)
        self._position = stop
        return self.permutation(self._epoch)[start:stop].tolist()

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle, "num_rows": self.num_rows,
                "epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume; refuses a state from another seed, shuffle setting or dataset size, or a corrupt one."""
        check_resume_state(self.what, state, {k: getattr(self, k) for k in _IDENTITY_KEYS})
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_rows:
            raise CheckpointError(f"{self.what} state has epoch={epoch}, position={position}, out of range "
                                  f"[0, {self.num_rows}]; the checkpoint is corrupt. Resume from another "
                                  "checkpoint or start a fresh run.")
        self._epoch, self._position = epoch, position


def check_resume_state(what: str, state: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Raise CheckpointError when `state` lacks a key of `expected` or disagrees with this run on one."""
    keys = [*expected, "epoch", "position"]
    missing = [k for k in keys if k not in state]
    if missing:
        raise CheckpointError(f"{what} state is missing {missing}; it was not written by this {what}'s "
                              "state_dict(). Resume from a complete checkpoint.")
    mismatch = {k: (state[k], v) for k, v in expected.items() if state[k] != v}
    if mismatch:
        detail = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in mismatch.items())
        raise CheckpointError(f"{what} state does not match this run ({detail}); resuming would not reproduce "
                              "the same order. Use the same seed, data.shuffle, batch size and training data "
                              "as the checkpointed run, or start a fresh run.")


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
        self.batch_size, self.drop_last = batch_size, drop_last
        self.order = ResumableOrder(num_rows, seed, shuffle, what="sampler")

    @property
    def num_rows(self) -> int:
        return self.order.num_rows

    @property
    def seed(self) -> int:
        return self.order.seed

    @property
    def shuffle(self) -> bool:
        return self.order.shuffle

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self.order.epoch

    @property
    def position(self) -> int:
        """Batches already handed out in the current epoch."""
        return -(-self.order.position // self.batch_size)

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_rows // self.batch_size
        return -(-self.num_rows // self.batch_size)

    def _rows_per_epoch(self) -> int:
        return len(self) * self.batch_size if self.drop_last else self.num_rows

    def next_batch(self) -> list[int]:
        """The next batch of indices, moving to a freshly shuffled epoch when one ends."""
        return self.order.take_from_epoch(self.batch_size, self._rows_per_epoch())

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {**self.order.state_dict(), "position": self.position, "batch_size": self.batch_size,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; refuses a state from a different dataset size, batch size, seed or shuffle setting."""
        check_resume_state("sampler", state, {"batch_size": self.batch_size, "drop_last": self.drop_last})
        position = int(state["position"])
        if not 0 <= position <= len(self):
            raise CheckpointError(f"sampler state has position={position} batches, out of range [0, {len(self)}]; "
                                  "the checkpoint is corrupt. Resume from another checkpoint or start a fresh run.")
        rows = min(position * self.batch_size, self._rows_per_epoch())
        self.order.load_state_dict({**state, "position": rows})


__all__ = ["ResumableOrder", "ResumableSampler", "check_resume_state"]
