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
        # every member must agree on the field layout before tensors of different shapes meet; all of them see
        # every layout, so all of them refuse a mismatch (none is left waiting in the gather)
        layouts = _all_gather_json([[k, d, s[1:]] for k, d, s in schema], group=group, members=len(ranks),
                                   device=device)
        for rank, theirs in zip(ranks, layouts, strict=True):
            if theirs != layouts[0]:
                raise DistributedError(
                    f"stage {stage!r}: rank {rank}'s batch fields {theirs} differ from rank {leader}'s "
                    f"{layouts[0]}. Fix: every rank of a group must produce the same fields, padded to one width."
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


def all_gather_batch(
    batch: Batch,
    *,
    group: Any,
    ranks: tuple[int, ...],
    guard: CollectiveGuard,
    stage: str,
    device: torch.device | None = None,
) -> tuple[Batch, list[int]]:
    """Every member's shard concatenated in rank order, on every member, and each member's row count.

    Shards may differ in rows, not in anything else (pad widths first: `pad_to_group_width`); the field
    names, dtypes and trailing shapes are checked against every member's before any tensor moves."""
    device = device or torch.device("cpu")
    n = next(iter(batch.values())).shape[0] if batch else 0
    if len(ranks) == 1:
        return batch, [n]

    def run() -> tuple[Batch, list[int]]:
        schema = [[k, d, s[1:]] for k, d, s in _schema(batch)]
        layouts = _all_gather_json(schema, group=group, members=len(ranks), device=device)
        if any(other != schema for other in layouts):
            raise DistributedError(f"stage {stage!r}: the ranks {list(ranks)} hold different batch fields "
                                   f"({layouts}). Fix: every rank of a group must produce the same fields, padded to "
                                   "one width")
        counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in ranks]
        dist.all_gather(counts, torch.tensor([n], dtype=torch.long, device=device), group=group)
        sizes = [int(c) for c in counts]
        out: Batch = {}
        for key, _dtype, _shape in schema:
            t = batch[key].to(device)
            padded = torch.zeros((max(sizes), *t.shape[1:]), dtype=t.dtype, device=device)
            padded[:n] = t
            parts = [torch.empty_like(padded) for _ in ranks]
            dist.all_gather(parts, padded, group=group)
            out[key] = torch.cat([p[:c] for p, c in zip(parts, sizes, strict=True)])
        return out, sizes

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



def pad_to_group_width(
    tensors: dict[str, torch.Tensor],
    sides: dict[str, tuple[str, int | float]],
    *,
    all_reduce_max: Any,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """Pad each tensor's dim 1 to the widest over a group, so the members' shards can be concatenated.

    `sides[name]` is ("left" | "right", pad value): prompts are left-padded, responses right-padded.
    `all_reduce_max(t)` takes the element-wise max of a long tensor over the group, in place; `device` is
    where the group's backend reduces (this rank's GPU under NCCL, which refuses CPU tensors).
    """
    names = sorted(tensors)
    widths = torch.tensor([tensors[k].shape[1] for k in names], dtype=torch.long, device=device)
    all_reduce_max(widths)
    out = {}
    for name, width in zip(names, widths.tolist(), strict=True):
        t = tensors[name]
        extra = width - t.shape[1]
        side, value = sides[name]
        out[name] = torch.nn.functional.pad(t, (extra, 0) if side == "left" else (0, extra), value=value)
    return out


def _all_gather_json(payload: Any, *, group: Any, members: int, device: torch.device) -> list[Any]:
    """Every member's JSON-serialisable `payload` (no pickling: bytes of JSON in uint8 tensors)."""
    data = torch.tensor(list(json.dumps(payload).encode()), dtype=torch.uint8, device=device)
    lengths = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(members)]
    dist.all_gather(lengths, torch.tensor([data.numel()], dtype=torch.long, device=device), group=group)
    width = max(int(n) for n in lengths)
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    parts = [torch.empty_like(padded) for _ in range(members)]
    dist.all_gather(parts, padded, group=group)
    return [json.loads(bytes(p[: int(n)].cpu().tolist()).decode()) for p, n in zip(parts, lengths, strict=True)]


def mean_over_owners(
    metrics: dict[str, float], *, group: Any, ranks: tuple[int, ...], guard: CollectiveGuard, device: torch.device
) -> dict[str, float]:
    """Each metric's mean over the ranks that hold it, returned on every rank of `ranks`.

    Ranks may hold different metrics (critic ones on critic ranks, actor ones on actor ranks, and the
    logging rank maybe neither): the names are all-gathered as JSON, then one all-reduce sums each value
    and its number of owners.
    """

    def exchange() -> dict[str, float]:
        lists = _all_gather_json(sorted(metrics), group=group, members=len(ranks), device=device)
        names = sorted(set().union(*lists))
        if not names:
            return {}
        sums = torch.tensor([[metrics.get(k, 0.0), float(k in metrics)] for k in names],
                            dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=group)
        return {k: s / c for k, (s, c) in zip(names, sums.tolist(), strict=True)}

    return guard.run("metrics:owners", ranks, exchange, group_name=role_key(ranks))
