"""The one resumable shuffled order over dataset rows, and the batch sampler built on it.

The permutation of epoch e is a pure function of (seed, stream, e), drawn from its own numpy Generator, so
it does not matter what else consumed global RNG state, and a run resumed from `state_dict()` sees exactly
the rows an uninterrupted run would have. The RL environments' prompt order, the SFT/DPO row stream and
the batch sampler all walk a `ResumableOrder`, so there is one state format and one set of resume checks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from verl.errors import CheckpointError, ConfigError, DataError

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
        if "mixture" in state:
            raise CheckpointError(f"{self.what} state was written by a run with data.mixture "
                                  f"({', '.join(map(str, state['mixture'].get('names', [])))}), and this run reads "
                                  "one dataset; resuming would not reproduce the same order. Resume with the same "
                                  "data.mixture, or start a fresh run.")
        check_resume_state(self.what, state, {k: getattr(self, k) for k in _IDENTITY_KEYS})
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_rows:
            raise CheckpointError(f"{self.what} state has epoch={epoch}, position={position}, out of range "
                                  f"[0, {self.num_rows}]; the checkpoint is corrupt. Resume from another "
                                  "checkpoint or start a fresh run.")
        self._epoch, self._position = epoch, position


def quotas(weights: Sequence[float], total: int) -> list[int]:
    """Slots per source in an epoch of `total` rows: shares of `weights`, rounded by largest remainder so they
    sum to `total` exactly (ties to the earlier source)."""
    s = float(sum(weights))
    exact = [w / s * total for w in weights]
    out = [int(math.floor(x)) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda k: (-(exact[k] - out[k]), k))
    for k in by_remainder[: total - sum(out)]:
        out[k] += 1
    return out


class MixtureOrder:
    """Rows of several sources drawn with fixed weights, in a seeded, resumable order.

    An epoch has as many slots as all sources have rows; source k owns `quotas(weights)[k]` of them, so the
    shares are exact within every epoch, not only on average. The slots are shuffled (a `ResumableOrder`),
    and a slot of source k takes that source's next row from its own `ResumableOrder`: a small source given
    a large weight cycles through its rows (each pass freshly shuffled), a large one given a small weight
    continues where it stopped, so every row is seen before any repeats. Indices are into the sources'
    rows laid end to end. With shuffle off the slots interleave the sources evenly and each source is read
    in order.
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int, shuffle: bool = True, *,
                 names: Sequence[str] | None = None, stream: tuple[int, ...] = (), what: str = "sampler") -> None:
        if len(sizes) != len(weights) or not sizes:
            raise ConfigError(f"a mixture needs one weight per source, got {len(sizes)} sources and "
                              f"{len(weights)} weights")
        bad = [f"{w!r}" for w in weights if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0)]
        if bad or sum(weights) <= 0:
            raise ConfigError(f"data.mixture weights {list(weights)}: each must be a number >= 0 and their sum > 0 "
                              "(they are relative shares: 0.7 and 0.3, or 7 and 3)")
        empty = [str(names[k] if names else k) for k, (n, w) in enumerate(zip(sizes, weights, strict=True))
                 if n <= 0 and w > 0]
        if empty:
            raise DataError(f"mixture source(s) {', '.join(empty)} have no rows but a weight > 0; check their files "
                            "and data reports, or give them weight 0")
        self.sizes, self.weights = [int(n) for n in sizes], [float(w) for w in weights]
        self.names = list(names) if names is not None else [str(k) for k in range(len(sizes))]
        self.what, self.seed, self.shuffle = what, int(seed), bool(shuffle)
        self.offsets = [0, *np.cumsum(self.sizes).tolist()]
        self.num_rows = self.offsets[-1]
        self.quotas = quotas(self.weights, self.num_rows)
        self._slots = ResumableOrder(self.num_rows, seed, shuffle, stream=(*stream, 0), what=what)
        self._parts = [ResumableOrder(n, seed, shuffle, stream=(*stream, 1, k), what=f"{what} (mixture {name})")
                       for k, (n, name) in enumerate(zip(self.sizes, self.names, strict=True))]
        layout = [(k, j) for k, q in enumerate(self.quotas) for j in range(q)]
        if not shuffle:  # spread each source's slots evenly over the epoch
            layout.sort(key=lambda kj: ((kj[1] + 0.5) / self.quotas[kj[0]], kj[0]))
        self._slot_source = np.asarray([k for k, _ in layout], dtype=np.int64)

    @property
    def epoch(self) -> int:
        return self._slots.epoch

    @property
    def position(self) -> int:
        return self._slots.position

    def source_of(self, index: int) -> int:
        """Which source a row index (into the sources laid end to end) belongs to."""
        return int(np.searchsorted(np.asarray(self.offsets[1:]), index, side="right"))

    def take(self, count: int) -> list[int]:
        """The next `count` row indices; like `ResumableOrder.take`, a take continues across epoch ends."""
        out = []
        for slot in self._slots.take(count):
            k = int(self._slot_source[slot])
            out.append(self.offsets[k] + self._parts[k].take(1)[0])
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**self._slots.state_dict(), "mixture": {
            "names": list(self.names), "sizes": list(self.sizes), "weights": list(self.weights),
            "sources": [p.state_dict() for p in self._parts]}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume; refuses a state of another mixture (names, sizes or weights) as well as `ResumableOrder`'s."""
        mix = state.get("mixture")
        if not isinstance(mix, Mapping):
            raise CheckpointError(f"{self.what} state has no mixture part; it was written by a run without "
                                  "data.mixture. Resume with that run's data settings, or start a fresh run.")
        check_resume_state(self.what, {**mix, "epoch": 0, "position": 0},
                           {"names": self.names, "sizes": self.sizes, "weights": self.weights})
        sources = mix.get("sources")
        if not isinstance(sources, list) or len(sources) != len(self._parts):
            raise CheckpointError(f"{self.what} state has {len(sources) if isinstance(sources, list) else 'no'} "
                                  f"mixture source states for {len(self._parts)} sources; the checkpoint is corrupt")
        self._slots.load_state_dict({k: v for k, v in state.items() if k != "mixture"})
        for part, part_state in zip(self._parts, sources, strict=True):
            part.load_state_dict(part_state)


def order_for(rows: Any, seed: int, shuffle: bool = True, *, stream: tuple[int, ...] = (),
              what: str = "sampler") -> ResumableOrder | MixtureOrder:
    """The order rows are drawn in: a `MixtureOrder` over a mixture's sources (rows with `.mixture`), else a
    `ResumableOrder` over all of them."""
    mixture = getattr(rows, "mixture", None)
    if mixture is not None:
        return MixtureOrder(mixture.sizes, mixture.weights, seed, shuffle, names=mixture.names, stream=stream,
                            what=what)
    return ResumableOrder(len(rows), seed, shuffle, stream=stream, what=what)


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


__all__ = ["MixtureOrder", "ResumableOrder", "ResumableSampler", "check_resume_state", "order_for", "quotas"]
