"""A test helper: every tensor verl hands to a collective must be on the device the real backend needs.

Under gloo on a CPU every tensor is a CPU tensor, so a tensor built with a hard-coded (or defaulted) CPU
device passes here and fails only on a GPU, where NCCL refuses it. The helper makes that mistake visible
on a CPU, faithfully: the code is given a *marker* device, `cpu:0`, as the device it runs on (`Placement(
device=...)`, `RoleGroups.create(device=...)`). It makes ordinary CPU tensors, so gloo runs as usual, but as
an argument it differs from the `cpu` that a hard-coded or default device gives. A TorchFunctionMode marks
every tensor made with the marker (a factory or `.to(marker)`) and every tensor computed from a marked one
(as on a GPU: an op on a CUDA tensor gives a CUDA tensor); an explicit other device unmarks. The wrapped
collectives then check that each tensor they get from verl code is marked, i.e. would be on the GPU.

Collectives of groups made with `backend="gloo"` (the checkpoint manager's CPU group) expect CPU tensors and
are not checked; nor are torch's own internal collectives (DCP, FSDP2, object collectives), which place
their tensors themselves.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

MARKER = torch.device("cpu", 0)
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "gather", "scatter", "reduce", "reduce_scatter",
               "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send",
               "recv", "isend", "irecv")


def _is_marker(value: Any) -> bool | None:
    """True for the marker device, False for any other device, None when `value` is no device."""
    if isinstance(value, torch.device):
        return value == MARKER and value.index == 0
    if isinstance(value, str):
        try:
            device = torch.device(value)
        except RuntimeError:
            return None
        return device.type == "cpu" and device.index == 0
    return None


class _Provenance(TorchFunctionMode):
    """Marks the tensors that would live on the role's device (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        # A mark on the tensor itself, not a weak reference to it: torch.utils.swap_tensors (FSDP2's
        # `to_empty` of a meta-built model) refuses tensors that have weak references.
        self._mark = f"_verl_placed_{id(self)}"

    def __contains__(self, t: torch.Tensor) -> bool:
        return getattr(t, self._mark, False) is True

    def add(self, t: torch.Tensor) -> None:
        try:
            setattr(t, self._mark, True)
        except (AttributeError, RuntimeError):  # a tensor type without attributes: left unmarked
            pass

    def discard(self, t: torch.Tensor) -> None:
        if t in self:
            delattr(t, self._mark)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves, _ = tree_flatten((args, kwargs))
        explicit = [m for m in (_is_marker(v) for v in leaves) if m is not None]
        if explicit:
            placed = explicit[0]
        else:
            placed = any(isinstance(v, torch.Tensor) and v in self for v in leaves)
        if placed:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.add(t)
        elif explicit:  # e.g. `.to("cpu")` / `.cpu()`-style explicit moves off the role's device
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.discard(t)
        return out


class CollectiveCheck:
    """What the check found: one line per tensor a collective got from verl code off the role's device."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.checked = 0
        self.cpu_groups: set[Any] = set()

    def assert_clean(self) -> None:
        assert self.checked > 0, "no collective was checked: the code under test ran none"
        assert not self.violations, "collectives got tensors off the role's device:\n" + "\n".join(self.violations)


def _verl_caller() -> str | None:
    """`module:line` of the verl code that called the collective (None when torch itself did)."""
    frame = sys._getframe(2)  # 0: this function, 1: the wrapper, 2: its caller
    module = frame.f_globals.get("__name__", "")
    return f"{module}:{frame.f_lineno}" if module.startswith("verl.") else None


@contextlib.contextmanager
def check_collective_devices() -> Iterator[CollectiveCheck]:
    """Within the block, check every collective verl calls (pass `MARKER` as the device the code runs on)."""
    check = CollectiveCheck()
    mode = _Provenance()
    originals = {name: getattr(dist, name) for name in (*COLLECTIVES, "new_group")}

    def wrap(name: str, real: Any) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            where = _verl_caller()
            if where is not None and group not in check.cpu_groups:
                check.checked += 1
                for t in tree_flatten((args, kwargs))[0]:
                    if isinstance(t, torch.Tensor) and t not in mode:
                        check.violations.append(f"dist.{name} at {where}: a {tuple(t.shape)} {t.dtype} tensor "
                                                "not made on the role's device")
            return real(*args, **kwargs)
        return collective

    def new_group(*args: Any, **kwargs: Any) -> Any:
        group = originals["new_group"](*args, **kwargs)
        if kwargs.get("backend") == "gloo":
            check.cpu_groups.add(group)
        return group

    for name in COLLECTIVES:
        setattr(dist, name, wrap(name, originals[name]))
    dist.new_group = new_group
    try:
        with mode:
            yield check
    finally:
        for name, real in originals.items():
            setattr(dist, name, real)
