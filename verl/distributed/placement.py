"""Where the stages of a training step run: the placement policy the one `step()` is written against.

A stage is a function batch -> batch run by one role. The trainer's batch lives on the *home* role's
ranks (the actor's, which sample it). `Placement.run(role, stage, batch)` runs a stage where its role is:

- colocated (every role on every rank, or one process): the stage simply runs; nothing moves;
- split (`devices.actor/critic/ref/reward` on different ranks): the home ranks send the fields the stage
  reads to the role's ranks, those run the stage on the concatenated batch (re-sharded over their own
  ranks) and send back the fields it wrote. Ranks outside both groups skip the stage.

So the stage itself never knows where it runs, and a subclass that overrides one stage is honoured in
both modes. Every rank calls every `run` of a step in the same order (the collectives are guarded).

The placement also owns the reductions "over the batch": sums over a role's data-parallel ranks (global
whitening, the KL controller's input, loss weights) and metric means over the ranks that hold them. With
tensor parallelism the data-parallel ranks are one rank of each tensor-parallel group (`RoleGroups.data_parallel`):
the ranks of a group hold the same rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from verl.distributed.groups import RoleGroups
from verl.distributed.guard import role_key
from verl.distributed.transfer import mean_over_owners, pad_to_group_width

B = TypeVar("B")
HOME = "actor"


class Placement:
    """Colocated roles (or one process): stages run in place; reductions go over the role's ranks."""

    split = False

    def __init__(self, groups: RoleGroups | None, *, rank: int = 0, world_size: int = 1,
                 device: torch.device | None = None, receive: Callable[[dict[str, torch.Tensor]], Any] | None = None,
                 ) -> None:
        self.groups = groups
        self.receive = receive  # builds the trainer's batch from received fields (split placements)
        self.rank = rank
        self.world_size = world_size
        # Every tensor a collective sees is made here: NCCL needs them on this rank's GPU, gloo on the CPU.
        self.device = device if device is not None else torch.device("cpu")

    @staticmethod
    def create(groups: RoleGroups | None, **kwargs: Any) -> Placement:
        """The placement for this run: split when some role sits on other ranks than the actor.

        `kwargs` are the constructor's (rank, world_size, device, receive)."""
        split = groups is not None and not groups.mapping.is_colocated()
        return (SplitPlacement if split else Placement)(groups, **kwargs)

    # ------------------------------------------------------------------ where roles are
    def holds(self, role: str) -> bool:
        """Whether this rank runs `role` (always true when colocated)."""
        return True

    def role_size(self, role: str) -> int:
        """How many ranks share `role`'s data (its data-parallel size)."""
        return len(self.groups.data_parallel(role)[1]) if self.groups is not None else 1

    # ------------------------------------------------------------------ stages
    def run(self, role: str, stage: Callable[[B], B], batch: B | None, *, send: Sequence[str] = (),
            back: Sequence[str] = ()) -> B | None:
        """Run `stage` on `role`'s ranks; returns the batch on the home ranks (None elsewhere).

        `send` names the fields the stage reads and `back` those it writes; they matter only when the
        role sits on other ranks than the home role. A `send` field the batch does not have (None, e.g. the
        observation mask of single-turn responses) is not sent; a `back` field must be there.
        """
        return stage(batch)

    def run_for_metrics(self, role: str, stage: Callable[[B], dict[str, float]], batch: B | None, *,
                        send: Sequence[str] = ()) -> dict[str, float]:
        """Run a stage that returns metrics (an update) on `role`'s ranks; other ranks get {}."""
        return stage(batch)

    def align(self, batch: B | None, sides: Mapping[str, tuple[str, int | float]]) -> B | None:
        """Pad the named fields of the home ranks' batches to one width before a split transfer (fields the
        batch does not have are left out)."""
        return batch

    # ------------------------------------------------------------------ reductions over the batch
    def all_reduce_sum(self, values: torch.Tensor, role: str = HOME) -> torch.Tensor:
        """Element-wise sum over `role`'s data-parallel ranks (float64 on the wire; identity in one process).

        Only ranks of `role` may call it; all of them must.
        """
        return self._all_reduce(values, role, dist.ReduceOp.SUM, "reduce:sum")

    def all_reduce_max(self, values: torch.Tensor, role: str = HOME) -> torch.Tensor:
        """Element-wise max over `role`'s data-parallel ranks (identity in one process)."""
        return self._all_reduce(values, role, dist.ReduceOp.MAX, "reduce:max")

    def _all_reduce(self, values: torch.Tensor, role: str, op: Any, stage: str) -> torch.Tensor:
        if self.groups is None:
            return values
        t = values.detach().to(self.device, torch.float64).clone()
        group, ranks = self.groups.data_parallel(role)
        if self.groups.has(role) and len(ranks) > 1 and dist.is_initialized():
            self.groups.guard.run(stage, ranks, lambda: dist.all_reduce(t, op=op, group=group),
                                  group_name=role_key(ranks))
        return t.to(values.device)

    def role_index(self, role: str = HOME) -> int:
        """This rank's position among `role`'s data-parallel ranks (0 in one process)."""
        return self.groups.data_parallel(role)[1].index(self.rank) if self.groups is not None else 0

    def all_gather_object(self, obj: Any, role: str = HOME) -> list[Any]:
        """Every `role` rank's `obj` (picklable; tensors on the CPU), in rank order; [obj] in one process.

        Only ranks of `role` may call it; all of them must."""
        if self.groups is None or self.role_size(role) == 1 or not dist.is_initialized():
            return [obj]
        group, ranks = self.groups.data_parallel(role)
        out: list[Any] = [None] * len(ranks)
        self.groups.guard.run("gather:objects", ranks,
                              lambda: dist.all_gather_object(out, obj, group=group),
                              group_name=role_key(ranks))
        return out

    def mean_over_owners(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric's mean over the ranks that computed it, on every rank (identity in one process)."""
        if self.groups is None:
            return metrics
        world = tuple(range(self.world_size))
        return mean_over_owners(metrics, group=dist.group.WORLD, ranks=world, guard=self.groups.guard,
                                device=self.device)


class SplitPlacement(Placement):
    """Roles on different ranks: the batch moves from the home ranks to a stage's role ranks and back."""

    split = True

    def __init__(self, groups: RoleGroups, **kwargs: Any) -> None:
        super().__init__(groups, **kwargs)
        self.home_ranks = groups.ranks(HOME)

    def holds(self, role: str) -> bool:
        return self.groups.has(role)

    def run(self, role, stage, batch, *, send=(), back=()):
        home = self.groups.has(HOME)
        if self.groups.ranks(role) == self.home_ranks:  # the role sits with the batch: nothing moves
            return stage(batch) if home else None
        name = getattr(stage, "__name__", "stage")
        got = self.groups.move_batch(_fields(batch, send, present=True) if home else None, HOME, role,
                                     stage=f"{name}:in")
        out = None
        if got is not None:
            result = stage(self._receive(got))
            out = _fields(result, back)
        returned = self.groups.move_batch(out, role, HOME, stage=f"{name}:out")
        if home:
            for key, value in returned.items():
                setattr(batch, key, value)
        return batch if home else None

    def run_for_metrics(self, role, stage, batch, *, send=()):
        if self.groups.ranks(role) == self.home_ranks:
            return stage(batch) if self.groups.has(HOME) else {}
        name = getattr(stage, "__name__", "stage")
        got = self.groups.move_batch(_fields(batch, send, present=True) if self.groups.has(HOME) else None,
                                     HOME, role, stage=f"{name}:in")
        return stage(self._receive(got)) if got is not None else {}

    def align(self, batch, sides):
        if not self.groups.has(HOME):
            return batch
        fields = _fields(batch, list(sides), present=True)
        padded = pad_to_group_width(
            fields, {k: sides[k] for k in fields},
            all_reduce_max=lambda t: self.groups.all_reduce(t, HOME, "align:width", op=dist.ReduceOp.MAX),
            device=self.device)
        for key, value in padded.items():
            setattr(batch, key, value)
        return batch

    def _receive(self, fields: dict[str, torch.Tensor]) -> Any:
        if self.receive is None:
            raise TypeError("a split placement moves batches between roles: create it with receive= the "
                            "trainer's batch constructor (e.g. RolloutBatch.from_fields)")
        return self.receive(fields)


def _fields(batch: Any, names: Sequence[str], *, present: bool = False) -> dict[str, torch.Tensor]:
    """The named tensors of a batch, as `move_batch` sends them; with `present`, those it has (not None).
    (Every home rank runs the same stages, so they agree on which fields are present.)"""
    fields = {name: getattr(batch, name) for name in names}
    return {k: v for k, v in fields.items() if v is not None} if present else fields


__all__ = ["Placement", "SplitPlacement", "HOME"]
