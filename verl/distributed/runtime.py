"""Process groups per role, batch transfer between groups, and collectives that time out loudly.

Two rules make role placement deadlock-free by construction:
  1. every process group is created up front, on every rank, in the fixed role order (new_group is a
     collective over the whole world);
  2. every transfer is a fixed sequence of group collectives that every member calls in the same order,
     preceded by an arrival check. If a rank is elsewhere (different stage) or never comes, the check
     raises DistributedError naming the stage and the missing ranks after `timeout_s`, instead of NCCL
     waiting forever.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from verl.config.fsdp import FSDPConfig
from verl.distributed.mapping import ROLES, DeviceMapping
from verl.errors import DeviceMappingError, DistributedError

T = TypeVar("T")
Batch = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------------
# Start-up
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: global/local rank, world, backend and its device."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str | None
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as err:
        raise DistributedError(
            f"environment variable {name}={value!r} is not an integer. Fix: launch with torchrun, which sets it."
        ) from err


def init_distributed(timeout_s: float = 600.0) -> DistEnv:
    """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK, ...).

    Without torchrun variables it returns a single-process env and initialises nothing, so the same code
    path runs on a laptop. Picks NCCL when CUDA is available, gloo otherwise, and binds the process to
    cuda:LOCAL_RANK after checking the ordinal exists (the usual "invalid device ordinal" crash).
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise DeviceMappingError(
                f"rank {rank} has LOCAL_RANK={local_rank} but this node sees only {count} CUDA device(s) "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Fix: torchrun "
                f"--nproc_per_node={count} or make more devices visible."
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if dist.is_initialized():
        return DistEnv(
            dist.get_rank(), dist.get_world_size(), local_rank, local_world_size, dist.get_backend(), device
        )
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return DistEnv(0, 1, 0, 1, None, device)
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise DistributedError(
            f"WORLD_SIZE={world_size} is set but {', '.join(missing)} is not. Fix: launch with "
            f"`torchrun --nproc_per_node=N -m verl.cli.main train ...` (or `verl train --nproc N`), which sets "
            f"all rendezvous variables."
        )
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if use_cuda:
        kwargs["device_id"] = device
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
    return DistEnv(rank, world_size, local_rank, local_world_size, backend, device)


# ---------------------------------------------------------------------------------------------------
# Arrival check: the timeout that names who is missing
# ---------------------------------------------------------------------------------------------------
class CollectiveGuard:
    """Before a collective, every member posts (stage) under a per-group sequence number in the store.

    Each rank then waits for the other members' posts. All present with the same stage: go. A post with a
    different stage: the ranks are running different collectives (a deadlock in the making) and all of
    them raise at once. A post missing after `timeout_s`: raise naming the stage and the absent ranks.
    This works for NCCL too, whose collectives otherwise block with no timeout on the host.
    """

    _instances = 0

    def __init__(self, timeout_s: float, *, store: Any | None = None, namespace: str | None = None) -> None:
        # A fresh key namespace per guard, so a new guard never reads a previous guard's posts. The
        # default counts constructions, which matches across ranks because every rank builds its guards
        # (RoleGroups.create) in the same order.
        CollectiveGuard._instances += 1
        self.timeout_s = float(timeout_s)
        self.namespace = namespace or f"verl/guard{CollectiveGuard._instances}"
        self._store = store
        self._seq: dict[str, int] = {}

    def _get_store(self) -> Any:
        if self._store is None:
            self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def arrive(
        self, stage: str, ranks: tuple[int, ...] | list[int], *, group_name: str | None = None
    ) -> None:
        """Block until every rank in `ranks` reached `stage` (this rank must be one of them)."""
        ranks = tuple(ranks)
        if len(ranks) <= 1 or not dist.is_initialized():
            return
        me = dist.get_rank()
        name = group_name or "g" + "_".join(map(str, ranks))
        seq = self._seq.get(name, 0)
        self._seq[name] = seq + 1
        store = self._get_store()
        prefix = f"{self.namespace}/arrive/{name}"
        store.set(f"{prefix}/{seq}/{me}", stage)
        keys = {r: f"{prefix}/{seq}/{r}" for r in ranks}
        try:
            store.wait(list(keys.values()), datetime.timedelta(seconds=self.timeout_s))
        except Exception as err:  # DistStoreError / RuntimeError depending on the store
            missing = [r for r, k in keys.items() if not store.check([k])]
            elsewhere = self._stages(store, keys, stage)
            detail = f"; ranks at a different stage: {elsewhere}" if elsewhere else ""
            raise DistributedError(
                f"collective timeout at stage {stage!r} (group {list(ranks)}, call #{seq}) on rank {me}: "
                f"rank(s) {missing} did not arrive within {self.timeout_s:g}s{detail}. Every rank of the group "
                f"must run the same collectives in the same order. Fix: look at the log of rank(s) {missing} "
                f"(crashed, slower, or skipped this stage); raise devices.timeout_s if they are only slow."
            ) from err
        elsewhere = self._stages(store, keys, stage)
        if elsewhere:
            raise DistributedError(
                f"collective mismatch at call #{seq} of group {list(ranks)}: rank {me} is at stage {stage!r} but "
                f"{elsewhere}. The ranks would deadlock. Fix: make every rank of the group call the same "
                f"stages in the same order (check for rank-dependent branches around the transfer)."
            )
        if seq > 0:  # everyone passed seq-1 once they posted seq; our old key is no longer read
            try:
                store.delete_key(f"{prefix}/{seq - 1}/{me}")
            except Exception:  # noqa: BLE001 - cleanup only; stores without delete keep the key
                pass

    @staticmethod
    def _stages(store: Any, keys: dict[int, str], stage: str) -> dict[int, str]:
        out: dict[int, str] = {}
        for r, k in keys.items():
            if store.check([k]):
                seen = store.get(k).decode()
                if seen != stage:
                    out[r] = seen
        return out

    def run(
        self,
        stage: str,
        ranks: tuple[int, ...] | list[int],
        fn: Callable[[], T],
        *,
        group_name: str | None = None,
    ) -> T:
        """Arrival check, then the collective `fn`; the stage name is added to any error it raises."""
        self.arrive(stage, ranks, group_name=group_name)
        try:
            return fn()
        except (DistributedError, DeviceMappingError):
            raise
        except RuntimeError as err:
            raise DistributedError(
                f"collective at stage {stage!r} (group {list(ranks)}) failed: {err}"
            ) from err


# ---------------------------------------------------------------------------------------------------
# Role groups
# ---------------------------------------------------------------------------------------------------
@dataclass
class RoleGroups:
    """Every role's process group (and FSDP mesh groups), created on every rank in one fixed order."""

    mapping: DeviceMapping
    rank: int
    guard: CollectiveGuard
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _groups: dict[tuple[int, ...], Any] = field(default_factory=dict)
    _mesh_groups: dict[str, tuple[tuple[int, int], Any, Any]] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        mapping: DeviceMapping,
        *,
        timeout_s: float = 600.0,
        fsdp: FSDPConfig | Mapping[str, FSDPConfig] | None = None,
        num_gpus_per_node: int | None = None,
        device: torch.device | None = None,
    ) -> RoleGroups:
        """Create the groups; must be called by every rank with the same arguments.

        Groups are keyed by their rank set, so colocated roles share one communicator. For roles whose
        FSDP strategy needs a 2-D mesh (HYBRID_SHARD, NO_SHARD) the shard and replicate sub-groups are
        created here too, so apply_fsdp never creates groups behind the back of non-member ranks.
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
        return self

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

    def _union_group(self, ranks: tuple[int, ...]) -> Any:
        group = self._groups.get(ranks)
        if group is None:
            raise DistributedError(
                f"no process group for ranks {list(ranks)}: transfer groups are created by "
                f"RoleGroups.create for every role pair. Fix: create RoleGroups with the same mapping on every rank."
            )
        return group


def role_key(ranks: tuple[int, ...]) -> str:
    """Group name used in the arrival store: the same for every rank of the group."""
    return "g" + "_".join(map(str, ranks))


# ---------------------------------------------------------------------------------------------------
# Batch collectives (usable on their own, with any group)
# ---------------------------------------------------------------------------------------------------
def _schema(batch: Batch) -> list[list[Any]]:
    out = []
    for key in sorted(batch):
        t = batch[key]
        if not isinstance(t, torch.Tensor):
            raise DistributedError(
                f"batch field {key!r} is {type(t).__name__}, not a tensor. Fix: move only tensors."
            )
        if t.dim() == 0:
            raise DistributedError(
                f"batch field {key!r} is a scalar; batch fields need a sample dimension (dim 0)."
            )
        out.append([key, str(t.dtype).removeprefix("torch."), list(t.shape)])
    return out


def _to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise DistributedError(f"received unknown dtype {name!r} in a batch schema")
    return dtype


def _broadcast_schema(schema: list | None, src_rank: int, group: Any, device: torch.device) -> list:
    if schema is not None:
        payload = torch.tensor(list(json.dumps(schema).encode()), dtype=torch.uint8, device=device)
        length = torch.tensor([payload.numel()], dtype=torch.long, device=device)
    else:
        length = torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(length, src=src_rank, group=group)
    if schema is None:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src_rank, group=group)
    return json.loads(bytes(payload.cpu().tolist()).decode())


def gather_batch(
    batch: Batch,
    *,
    group: Any,
    ranks: tuple[int, ...],
    guard: CollectiveGuard,
    stage: str,
    device: torch.device | None = None,
) -> Batch | None:
    """Concatenate every member's shard on the first rank of `ranks` (others get None).

    Shards may differ in length; fields must agree in dtype and trailing shape (checked on the leader).
    """
    me = dist.get_rank()
    leader = ranks[0]
    device = device or torch.device("cpu")
    if len(ranks) == 1:
        return batch

    def run() -> Batch | None:
        schema = _schema(batch)
        counts = torch.zeros(len(ranks), dtype=torch.long, device=device)
        n = next(iter(batch.values())).shape[0] if batch else 0
        for key, t in batch.items():
            if t.shape[0] != n:
                raise DistributedError(
                    f"stage {stage!r}: batch field {key!r} has {t.shape[0]} rows but others have {n} on rank {me}. "
                    f"Fix: every field needs the same number of samples."
                )
        counts[ranks.index(me)] = n
        dist.all_reduce(counts, group=group)
        # every member must agree on the field layout before tensors of different shapes meet
        leader_schema = _broadcast_schema(schema if me == leader else None, leader, group, device)
        mine = [[k, d, s[1:]] for k, d, s in schema]
        theirs = [[k, d, s[1:]] for k, d, s in leader_schema]
        if mine != theirs:
            raise DistributedError(
                f"stage {stage!r}: rank {me}'s batch fields {mine} differ from rank {leader}'s {theirs}. "
                f"Fix: every rank of a group must produce the same fields."
            )
        max_n = int(counts.max().item())
        out: Batch = {}
        for key, _dtype, shape in schema:
            t = batch[key].to(device)
            padded = torch.zeros((max_n, *shape[1:]), dtype=t.dtype, device=device)
            padded[: t.shape[0]] = t
            bucket = [torch.empty_like(padded) for _ in ranks] if me == leader else None
            dist.gather(padded, gather_list=bucket, dst=leader, group=group)
            if me == leader:
                out[key] = torch.cat([b[: int(c)] for b, c in zip(bucket, counts.tolist(), strict=True)])
        return out if me == leader else None

    return guard.run(stage, ranks, run, group_name=role_key(ranks))


def broadcast_batch(
    batch: Batch | None,
    *,
    src_rank: int,
    group: Any,
    ranks: tuple[int, ...],
    guard: CollectiveGuard,
    stage: str,
    device: torch.device | None = None,
) -> Batch:
    """Send the whole batch from `src_rank` to every rank of `ranks`; the schema travels as JSON."""
    me = dist.get_rank()
    device = device or torch.device("cpu")
    if len(ranks) == 1:
        assert batch is not None
        return batch

    def run() -> Batch:
        if me == src_rank and batch is None:
            raise DistributedError(f"stage {stage!r}: source rank {me} has no batch to send.")
        schema = _broadcast_schema(_schema(batch) if me == src_rank else None, src_rank, group, device)
        out: Batch = {}
        for key, dtype, shape in schema:
            if me == src_rank:
                t = batch[key].to(device).contiguous()
            else:
                t = torch.empty(shape, dtype=_to_dtype(dtype), device=device)
            dist.broadcast(t, src=src_rank, group=group)
            out[key] = t
        return out

    return guard.run(stage, ranks, run, group_name=role_key(ranks))


def shard_batch(batch: Batch, index: int, parts: int) -> Batch:
    """Contiguous shard `index` of `parts` along dim 0 (torch.tensor_split order: sizes differ by <= 1)."""
    return {k: torch.tensor_split(t, parts, dim=0)[index] for k, t in batch.items()}


__all__ = [
    "DistEnv",
    "init_distributed",
    "CollectiveGuard",
    "RoleGroups",
    "gather_batch",
    "broadcast_batch",
    "shard_batch",
    "role_key",
]
