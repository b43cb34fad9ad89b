"""The rollout's KV cache: preallocated, written in place, grown when a rollout outlives its plan, and able
to set rows aside and take them back (multi-turn episodes whose turn ended while others still write).

``DynamicLayer`` concatenates on every step, copying the whole cache each time; here a step writes one
slot and returns views of the filled part. The layers subclass transformers' own, so models treat the
cache as the ``DynamicCache`` they expect. Only full-attention models use it: a sliding-window or linear-
attention layer keeps a different layout, and those models run on the model's own cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:  # transformers >= 4.56 has per-layer caches; older versions use a plain DynamicCache.
    from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - depends on the installed transformers
    from transformers.cache_utils import DynamicCache

    Cache = DynamicLayer = None  # type: ignore[assignment,misc]

Parked = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) of some rows, one pair per layer


def model_cache(config: Any) -> Any:
    """The model's own cache layout (sliding-window layers included) where transformers knows it."""
    try:
        return DynamicCache(config=config)
    except TypeError:  # transformers < 4.56 builds the layout lazily
        return DynamicCache()


if DynamicLayer is not None:

    class _RolloutLayer(DynamicLayer):
        """One layer's keys and values in buffers with room for ``capacity`` positions."""

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self.length = 0

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                                **kwargs: Any) -> None:
            batch, heads, _, head_dim = key_states.shape
            self.device = key_states.device
            self.key_buf = key_states.new_empty(batch, heads, self.capacity, head_dim)
            self.value_buf = value_states.new_empty(batch, value_states.shape[1], self.capacity,
                                                    value_states.shape[-1])
            self.is_initialized = True

        def _refresh_views(self) -> None:
            self.keys = self.key_buf[:, :, : self.length]
            self.values = self.value_buf[:, :, : self.length]

        def _grow(self, needed: int) -> None:
            """Double the buffers: how many turns an episode takes is only known while it runs."""
            capacity = max(needed, 2 * self.capacity)
            for name in ("key_buf", "value_buf"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[0], old.shape[1], capacity, old.shape[3])
                new[:, :, : self.length] = old[:, :, : self.length]
                setattr(self, name, new)
            self.capacity = capacity

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start, stop = self.length, self.length + key_states.shape[-2]
            if stop > self.capacity:
                self._grow(stop)
            self.key_buf[:, :, start:stop] = key_states
            self.value_buf[:, :, start:stop] = value_states
            self.length = stop
            self._refresh_views()
            return self.keys, self.values

        def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
            return self.length

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self.key_buf = self.key_buf.index_select(0, indices)
                self.value_buf = self.value_buf.index_select(0, indices)
                self._refresh_views()

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self.key_buf = self.key_buf.repeat_interleave(repeats, dim=0)
                self.value_buf = self.value_buf.repeat_interleave(repeats, dim=0)
                self._refresh_views()

        def reset(self) -> None:
            self.length = 0
            self.is_initialized = False
            self.keys = self.values = None

    class RolloutCache(DynamicCache):
        """A ``DynamicCache`` (so models treat it as one) whose layers are :class:`_RolloutLayer`."""

        def __init__(self, num_layers: int, capacity: int) -> None:
            Cache.__init__(self, layers=[_RolloutLayer(capacity) for _ in range(num_layers)])

        def park(self, rows: torch.Tensor) -> Parked:
            """Copies of these rows' keys and values (every layer), to take them out of the batch."""
            return [(layer.keys.index_select(0, rows), layer.values.index_select(0, rows)) for layer in self.layers]

        def unpark(self, parked: Sequence[Parked], order: torch.Tensor) -> None:
            """The batch becomes (its rows, then every parked group's rows)[order]. A parked row is shorter
            than the others by the steps it sat out: its missing columns are zero-filled holes (the caller
            masks them), so later tokens attend to exactly its real columns."""
            for i, layer in enumerate(self.layers):
                length = layer.length
                for name, j in (("key_buf", 0), ("value_buf", 1)):
                    buf = getattr(layer, name)
                    rows = [buf[:, :, :length]]
                    for group in parked:
                        kv = group[i][j]
                        rows.append(torch.nn.functional.pad(kv, (0, 0, 0, length - kv.shape[2])))
                    merged = buf.new_empty(len(order), buf.shape[1], layer.capacity, buf.shape[3])
                    merged[:, :, :length] = torch.cat(rows).index_select(0, order)
                    setattr(layer, name, merged)
                layer._refresh_views()

        def trim(self, length: int, start: int, holes: torch.Tensor) -> None:
            """Keep the first `length` positions and zero the columns from `start` where `holes` [B, length -
            start] is True. A decode that learns of ended rows only every few tokens computes on past their
            ends (and past the last one); trimmed, its cache equals that of one that dropped every row at its
            end: the same length, zero-filled holes (which the caller masks) where a row sat out."""
            for layer in self.layers:
                if not layer.is_initialized:
                    continue
                layer.length = min(layer.length, length)
                drop = holes[:, None, : layer.length - start, None]
                for buf in (layer.key_buf, layer.value_buf):
                    buf[:, :, start: layer.length].masked_fill_(drop, 0)
                layer._refresh_views()

else:  # pragma: no cover - transformers without per-layer caches
    RolloutCache = None  # type: ignore[assignment,misc]


__all__ = ["Parked", "RolloutCache", "model_cache"]
