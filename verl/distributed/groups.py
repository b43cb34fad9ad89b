"""Every role's process group, created up front on every rank in one fixed order.

Two rules make role placement deadlock-free by construction:
  1. every process group is created up front, on every rank, in the fixed role order (new_group is a
     collective over the whole world);
  2. every transfer is a fixed sequence of group collectives that every member calls in the same order,
     preceded by an arrival check (`CollectiveGuard`), which names the stage and the missing ranks after
     `timeout_s` instead of waiting forever.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from verl.config.fsdp import FSDPConfig
from verl.distributed.guard import CollectiveGuard, role_key
from verl.distributed.mapping import ROLES, DeviceMapping
from verl.distributed.sequence_parallel import SequenceParallel, sequence_parallel_layout
from verl.distributed.transfer import Batch, broadcast_batch, gather_batch, shard_batch
from verl.errors import DeviceMappingError, DistributedError


@dataclass
class RoleGroups:
    """Every role's process group (and FSDP mesh groups), created on every rank in one fixed order."""

    mapping: DeviceMapping
    rank: int
    guard: CollectiveGuard
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _groups: dict[tuple[int, ...], Any] = field(default_factory=dict)
    _mesh_groups: dict[str, tuple[tuple[int, int], Any, Any]] = field(default_factory=dict)
    _sequence_parallel: SequenceParallel | None = None
    # actor.tensor_parallel_size > 1: ((dp, tp), this rank's dp group and ranks, its tp group and ranks)
    _tensor_parallel: tuple[tuple[int, int], Any, tuple[int, ...], Any, tuple[int, ...]] | None = None

    @classmethod
    def create(
        cls,
        mapping: DeviceMapping,
        *,
        timeout_s: float = 600.0,
        fsdp: FSDPConfig | Mapping[str, FSDPConfig] | None = None,
        num_gpus_per_node: int | None = None,
        device: torch.device | None = None,
        sequence_parallel: int = 1,
        tensor_parallel: int = 1,
    ) -> RoleGroups:
        """Create the groups; must be called by every rank with the same arguments.

        Groups are keyed by their rank set, so colocated roles share one communicator. For roles whose
        FSDP strategy needs a 2-D mesh (HYBRID_SHARD, NO_SHARD) the shard and replicate sub-groups are
        created here too, so apply_fsdp never creates groups behind the back of non-member ranks, and so are
        the actor's sequence-parallel groups (`sequence_parallel` consecutive actor ranks each) and its
        (data-parallel x tensor-parallel) mesh's groups (`tensor_parallel` consecutive actor ranks each, and the
        columns across them; every role sits on the actor's ranks then: the start-up checks refuse others).
        """
        initialized = dist.is_initialized()
        rank = dist.get_rank() if initialized else 0
        world = dist.get_world_size() if initialized else 1
        if world != mapping.world_size:
            raise DeviceMappingError(
                f"the mapping was validated for world size {mapping.world_size} but {world} process(es) are "
                f"running. Fix: validate with world_size={world}."
            )
        timeout = datetime.timedelta(seconds=timeout_s)
        self = cls(
            mapping=mapping, rank=rank, guard=CollectiveGuard(timeout_s), device=device or torch.device("cpu")
        )

        def group_for(ranks: tuple[int, ...]) -> Any:
            if ranks not in self._groups:
                if not initialized:
                    self._groups[ranks] = None
                elif ranks == tuple(range(world)):
                    self._groups[ranks] = dist.group.WORLD
                else:
                    self._groups[ranks] = dist.new_group(list(ranks), timeout=timeout)
            return self._groups[ranks]

        active = [role for role in ROLES if role in mapping.roles]
        for role in active:  # fixed order: identical new_group sequence on every rank
            group_for(mapping.roles[role])
        for i, a in enumerate(active):  # transfer groups: src ∪ dst for every role pair
            for b in active[i + 1 :]:
                group_for(tuple(sorted(set(mapping.roles[a]) | set(mapping.roles[b]))))
        if "rollout" in mapping.roles:  # weight delivery: the first actor rank to the rollout ranks
            group_for(tuple(sorted({mapping.roles["actor"][0], *mapping.roles["rollout"]})))
        for role in ROLES:
            if role not in mapping.roles:
                continue
            cfg = fsdp.get(role) if isinstance(fsdp, Mapping) else fsdp
            if cfg is None or cfg.sharding_strategy not in ("HYBRID_SHARD", "NO_SHARD"):
                continue
            ranks = mapping.roles[role]
            shard = cfg.shard_group_size(len(ranks), num_gpus_per_node=num_gpus_per_node)
            cfg.check(len(ranks), num_gpus_per_node=num_gpus_per_node, key=f"{role}.fsdp")
            replicas = len(ranks) // shard
            grid = [list(ranks[i * shard : (i + 1) * shard]) for i in range(replicas)]
            mine_shard = mine_rep = None
            for row in grid:  # shard groups: rows of the grid
                g = group_for(tuple(row))
                if rank in row:
                    mine_shard = g
            for col in range(shard):  # replicate groups: columns of the grid
                members = tuple(grid[i][col] for i in range(replicas))
                g = group_for(members)
                if rank in members:
                    mine_rep = g
            self._mesh_groups[role] = ((replicas, shard), mine_rep, mine_shard)
        if sequence_parallel > 1:
            for members in sequence_parallel_layout(mapping.roles["actor"], sequence_parallel):
                g = group_for(members)
                if rank in members:
                    self._sequence_parallel = SequenceParallel(g, members, members.index(rank))
        if tensor_parallel > 1:
            actor = mapping.roles["actor"]
            if len(actor) % tensor_parallel:
                raise DeviceMappingError(f"actor.tensor_parallel_size={tensor_parallel} does not divide the actor's "
                                         f"{len(actor)} rank(s). Fix: launch a multiple of {tensor_parallel}")
            dp = len(actor) // tensor_parallel
            rows = [tuple(actor[i * tensor_parallel : (i + 1) * tensor_parallel]) for i in range(dp)]
            cols = [tuple(row[j] for row in rows) for j in range(tensor_parallel)]
            for members in [*rows, *cols]:  # every rank creates every group, in one order
                group_for(members)
            if rank in actor:
                tp_ranks = next(r for r in rows if rank in r)
                dp_ranks = next(c for c in cols if rank in c)
                self._tensor_parallel = ((dp, tensor_parallel), group_for(dp_ranks), dp_ranks,
                                         group_for(tp_ranks), tp_ranks)
        return self

    @property
    def tensor_parallel_size(self) -> int:
        """The actor's tensor-parallel size on this rank (1: off, or not an actor rank)."""
        return self._tensor_parallel[0][1] if self._tensor_parallel is not None else 1

    def tensor_parallel_mesh(self, device_type: str | None = None) -> Any:
        """The actor's 2-D (dp, tp) DeviceMesh (`verl.distributed.tensor_parallel`): `mesh["tp"]` for
        `apply_tensor_parallel`, `mesh["dp"]` for FSDP2; None without tensor parallelism."""
        from torch.distributed.device_mesh import DeviceMesh

        if self._tensor_parallel is None:
            return None
        (dp, tp), dp_group, _, tp_group, _ = self._tensor_parallel
        return DeviceMesh.from_group([dp_group, tp_group], device_type or self.device.type,
                                     mesh=torch.tensor(self.mapping.roles["actor"], dtype=torch.int).view(dp, tp),
                                     mesh_dim_names=("dp", "tp"))

    def data_parallel(self, role: str) -> tuple[Any, tuple[int, ...]]:
        """The group and ranks over which `role`'s rows are data-parallel: its ranks, or with tensor parallelism
        this rank's column of the (dp, tp) mesh (one rank of each tensor-parallel group: the ranks of a group
        hold the same rows, so a sum over the column counts each row once, and every rank of a group gets the
        same result)."""
        if self._tensor_parallel is not None:
            _, group, ranks, _, _ = self._tensor_parallel
            return group, ranks
        return self.group(role), self.ranks(role)

    def sequence_parallel(self) -> SequenceParallel | None:
        """This actor rank's sequence-parallel group (None without sequence parallelism, or off the actor)."""
        return self._sequence_parallel

    def group(self, role: str) -> Any:
        """The ProcessGroup of `role` (None when not running distributed)."""
        return self._groups[self.mapping.ranks(role)]

    def ranks(self, role: str) -> tuple[int, ...]:
        return self.mapping.ranks(role)

    def has(self, role: str) -> bool:
        """Whether this rank takes part in `role`."""
        return role in self.mapping.roles and self.rank in self.mapping.roles[role]

    def mesh(self, role: str, device_type: str | None = None) -> Any:
        """The DeviceMesh FSDP2 shards `role` over: 1-D over its group, 2-D for HYBRID_SHARD/NO_SHARD.

        Only members of the role may ask (a mesh of groups this rank is not in is meaningless).
        """
        from torch.distributed.device_mesh import DeviceMesh

        if not self.has(role):
            raise DistributedError(
                f"rank {self.rank} asked for the {role} mesh but is not one of its ranks {list(self.ranks(role))}. "
                f"Fix: guard the call with role_groups.has({role!r})."
            )
        dtype = device_type or self.device.type
        ranks = self.mapping.ranks(role)
        if role in self._mesh_groups:
            (replicas, shard), rep, sh = self._mesh_groups[role]
            return DeviceMesh.from_group(
                [rep, sh],
                dtype,
                mesh=torch.tensor(ranks, dtype=torch.int).view(replicas, shard),
                mesh_dim_names=("replicate", "shard"),
            )
        return DeviceMesh.from_group(self.group(role), dtype, mesh=torch.tensor(ranks, dtype=torch.int))

    # --- guarded collectives over a role's group -----------------------------------------------
    def barrier(self, role: str, stage: str) -> None:
        """Arrival check over the role's ranks (the check is itself the barrier)."""
        if self.has(role):
            self.guard.arrive(stage, self.ranks(role), group_name=role_key(self.ranks(role)))

    def all_reduce(self, tensor: torch.Tensor, role: str, stage: str, op: Any = None) -> torch.Tensor:
        """In-place all-reduce (sum by default) over the role's group, behind the arrival check."""
        if not self.has(role) or len(self.ranks(role)) == 1 or not dist.is_initialized():
            return tensor
        ranks = self.ranks(role)
        op = dist.ReduceOp.SUM if op is None else op
        self.guard.run(
            stage,
            ranks,
            lambda: dist.all_reduce(tensor, op=op, group=self.group(role)),
            group_name=role_key(ranks),
        )
        return tensor

    def move_batch(self, batch: Batch | None, src: str, dst: str, *, stage: str) -> Batch | None:
        """Move a data-parallel batch from the `src` role's ranks to the `dst` role's ranks.

        Every rank of the world calls this with the same (src, dst, stage), in the same order; ranks in
        neither group return immediately. On src ranks `batch` is this rank's shard (dim 0 = samples);
        dst ranks get back their contiguous shard of the concatenated batch (torch.tensor_split order),
        others get None. Sequence: gather to the src leader inside src, broadcast schema + tensors from
        the src leader over src ∪ dst, each dst rank keeps its slice. No pickling: the schema is JSON.
        """
        src_ranks, dst_ranks = self.ranks(src), self.ranks(dst)
        in_src, in_dst = self.rank in src_ranks, self.rank in dst_ranks
        if not dist.is_initialized() or (src_ranks == dst_ranks):
            return batch if in_dst else None
        if not (in_src or in_dst):
            return None
        if in_src and batch is None:
            raise DistributedError(
                f"stage {stage!r}: rank {self.rank} belongs to the {src} group {list(src_ranks)} but passed no batch. "
                f"Fix: every {src} rank must pass its shard to move_batch."
            )
        full: Batch | None = None
        if in_src:
            full = gather_batch(
                batch,
                group=self.group(src),
                ranks=src_ranks,
                guard=self.guard,
                stage=f"{stage}:gather[{src}]",
                device=self.device,
            )
        union = tuple(sorted(set(src_ranks) | set(dst_ranks)))
        union_group = self._union_group(union)
        full = broadcast_batch(
            full,
            src_rank=src_ranks[0],
            group=union_group,
            ranks=union,
            guard=self.guard,
            stage=f"{stage}:send[{src}->{dst}]",
            device=self.device,
        )
        if not in_dst:
            return None
        return shard_batch(full, dst_ranks.index(self.rank), len(dst_ranks))

    def group_of(self, ranks: tuple[int, ...]) -> Any:
        """The process group RoleGroups.create made for exactly these ranks (a DistributedError otherwise)."""
        return self._union_group(ranks)

    def _union_group(self, ranks: tuple[int, ...]) -> Any:
        group = self._groups.get(ranks)
        if group is None:
            raise DistributedError(
                f"no process group for ranks {list(ranks)}: transfer groups are created by "
                f"RoleGroups.create for every role pair. Fix: create RoleGroups with the same mapping on every rank."
            )
        return group

