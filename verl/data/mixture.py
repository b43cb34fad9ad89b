"""Several prompt sources behind one sequence, each row tagged with the source it came from.

`data.mixture` names sources (files) with weights; the trainer reads each source like `data.train_files`
(its own report) and lays their rows end to end in a `MixtureRows`. The rows stay where each source keeps
them (a `RowIndex` reads them on demand); `MixtureRows.mixture` tells `sampler.order_for` to draw with the
weights (`MixtureOrder`), and each row's `mixture` key names its source, which the trainer's per-source
metrics group by.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from verl.data.index import RowFacts, row_facts, rows_at
from verl.errors import ConfigError

MIXTURE_KEY = "mixture"  # the row key naming its source


@dataclass(frozen=True)
class MixtureSpec:
    names: list[str]
    sizes: list[int]
    weights: list[float]


class MixtureRows(Sequence):
    """The rows of several sources laid end to end; `rows[i]` is a fresh dict with `mixture: <name>`."""

    def __init__(self, parts: Sequence[Sequence[Any]], names: Sequence[str], weights: Sequence[float]) -> None:
        if not (len(parts) == len(names) == len(weights)) or not parts:
            raise ConfigError(f"a mixture needs a name and a weight per source; got {len(parts)} sources, "
                              f"{len(names)} names and {len(weights)} weights")
        self.parts, self.names, self.weights = list(parts), list(names), [float(w) for w in weights]
        self._ends: list[int] = []
        total = 0
        for part in self.parts:
            total += len(part)
            self._ends.append(total)

    @property
    def mixture(self) -> MixtureSpec:
        return MixtureSpec(list(self.names), [len(p) for p in self.parts], list(self.weights))

    def __len__(self) -> int:
        return self._ends[-1]

    def _locate(self, i: int) -> tuple[int, int]:
        k = bisect.bisect_right(self._ends, i)
        return k, i - (self._ends[k - 1] if k else 0)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self.subset(range(len(self))[i])
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} rows")
        return self.get_many([i % n])[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for part, name in zip(self.parts, self.names, strict=True):
            for row in part:
                yield _tagged(row, name, copy_row=not hasattr(part, "get_many"))

    def get_many(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The rows at `indices` (fresh dicts, tagged), each source's rows read together."""
        where = [self._locate(int(i)) for i in indices]
        out: list[Any] = [None] * len(where)
        for k, part in enumerate(self.parts):
            js = [j for j, (kk, _) in enumerate(where) if kk == k]
            if js:
                for j, row in zip(js, rows_at(part, [where[j][1] for j in js]), strict=True):
                    out[j] = _tagged(row, self.names[k], copy_row=not hasattr(part, "get_many"))
        return out

    def subset(self, indices: Sequence[int]) -> MixtureRows:
        """The rows at `indices` (sorted, as a hold-out split gives them), still a mixture of the same sources."""
        per: list[list[int]] = [[] for _ in self.parts]
        for i in indices:
            k, j = self._locate(int(i))
            per[k].append(j)
        parts = [p.subset(js) if hasattr(p, "subset") else [p[j] for j in js]
                 for p, js in zip(self.parts, per, strict=True)]
        return MixtureRows(parts, self.names, self.weights)

    def facts(self) -> Iterator[RowFacts]:
        for part in self.parts:
            yield from row_facts(part)


def _tagged(row: Any, name: str, copy_row: bool) -> dict[str, Any]:
    out = copy.deepcopy(dict(row)) if copy_row else row
    out[MIXTURE_KEY] = name
    return out


__all__ = ["MIXTURE_KEY", "MixtureRows", "MixtureSpec"]
