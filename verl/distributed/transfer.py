"""Batch collectives between role groups: gather a role's shards, broadcast them to another group, keep
one shard; pad shards to a common width first. Field names and shapes travel as JSON, never pickled."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from verl.distributed.guard import CollectiveGuard, role_key
from verl.errors import DistributedError

Batch = dict[str, torch.Tensor]


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

