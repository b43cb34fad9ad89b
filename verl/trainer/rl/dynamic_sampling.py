"""DAPO's dynamic sampling: train only on groups whose rewards differ, drawing more prompts while short.

Every rank takes part in every round (the prompt stream and FSDP's collectives stay in step); the loop is
here, the drawing (get a batch, generate, score) is the trainer's stages, passed in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl.batch import LAYOUT, ROW_LIST, WHOLE, RolloutBatch, concat_batches, varied_groups
from verl.distributed.placement import Placement


def filter_groups(batch: RolloutBatch | None, draw: Callable[[int], RolloutBatch | None], *, placement: Placement,
                  max_rounds: int, pad_token_id: int,
                  metrics: dict[str, float]) -> RolloutBatch | None:
    """Keep the groups whose accuracies differ (`varied_groups`); while the actor ranks together hold fewer
    than the global batch, every rank `draw(round)`s and scores another batch, at most `max_rounds` times.
    The varied groups are then dealt out over the actor ranks (`share_varied`), so that no rank fills with
    equal-accuracy groups (which the update skips, actor.skip_zero_advantage) while another throws varied
    ones away; only a global shortfall is filled. None on non-actor ranks."""
    holds = placement.holds("actor")
    want = len(batch) if holds else 0
    kept, rejected, sampled, rounds = [], [], 0, 0
    current = batch
    while True:
        if holds:
            varied = varied_groups(current)
            kept.append(current.select(varied.nonzero().flatten()))
            rejected.append(current.select((~varied).nonzero().flatten()))
            sampled += len(current)
        # the global batch's shortfall, known to every rank (the means are over the actor ranks)
        mean = placement.mean_over_owners({"kept": float(sum(len(k) for k in kept)), "want": float(want)}
                                          if holds else {})
        if rounds >= max_rounds or mean.get("kept", 0.0) >= mean.get("want", 0.0):
            break
        rounds += 1
        current = draw(rounds)
    metrics["dynamic_sampling/rounds"] = float(rounds)
    if not holds:
        return None
    varied, received = share_varied(concat_batches(kept, pad_token_id), want, _group_size(batch), placement,
                                    pad_token_id)
    out = concat_batches([varied, *rejected], pad_token_id).select(torch.arange(want))
    out.metrics = batch.metrics
    metrics["dynamic_sampling/varied_group_frac"] = sum(len(k) for k in kept) / max(sampled, 1)
    metrics["dynamic_sampling/filled_equal_frac"] = max(want - len(varied), 0) / max(want, 1)
    metrics["dynamic_sampling/received_frac"] = received / max(want, 1)
    return out


def _group_size(batch: RolloutBatch) -> int:
    groups = len(torch.unique(batch.group_ids.cpu()))
    return len(batch) // max(groups, 1)


def share_varied(varied: RolloutBatch, want: int, n: int, placement: Placement,
                 pad_token_id: int) -> tuple[RolloutBatch, int]:
    """This actor rank's varied groups after dealing them out over the actor ranks, and the rows it received.

    Each rank keeps up to `want` rows of its own (whole groups of `n` rows, in order); the surplus groups of
    all ranks form one pool, in rank order, that fills the ranks short of `want`, in rank order. Only the
    pooled groups some rank takes travel (on the CPU, pickled), and every rank computes the same plan from
    the gathered counts."""
    size = placement.role_size("actor")
    have = len(varied) // n
    if size == 1:
        return varied.select(torch.arange(min(len(varied), want))), 0
    me = placement.role_index("actor")
    counts = torch.zeros(size, 2, dtype=torch.float64)
    counts[me] = torch.tensor([float(want // n), float(have)])
    counts = placement.all_reduce_sum(counts, "actor").long()
    keep = torch.minimum(counts[:, 0], counts[:, 1])
    surplus, deficit = counts[:, 1] - keep, counts[:, 0] - keep
    moved = int(min(surplus.sum(), deficit.sum()))
    give_start = int(surplus[:me].sum())  # my surplus' place in the pool
    give = max(min(int(surplus[me]), moved - give_start), 0)
    mine = int(keep[me])
    given = varied.select(torch.arange(mine * n, (mine + give) * n))
    pieces = [p for p in placement.all_gather_object(_to_cpu(given) if give else None, "actor") if p is not None]
    take_start = min(int(deficit[:me].sum()), moved)
    take = min(int(deficit[me]), moved - take_start)
    own = varied.select(torch.arange(mine * n))
    if not take:
        return own, 0
    pool = concat_batches(pieces, pad_token_id)
    got = _to_devices(pool.select(torch.arange(take_start * n, (take_start + take) * n)), own)
    return concat_batches([own, got], pad_token_id), take * n


def _to_cpu(batch: RolloutBatch) -> RolloutBatch:
    out = batch.select(torch.arange(len(batch)))
    for name, f in LAYOUT.items():
        value = getattr(out, name)
        if f.kind not in (ROW_LIST, WHOLE) and value is not None:
            setattr(out, name, value.cpu())
    out.metrics = {}
    return out


def _to_devices(batch: RolloutBatch, like: RolloutBatch) -> RolloutBatch:
    """`batch`'s tensors on the devices of `like`'s same fields (a received batch joins a local one)."""
    for name, f in LAYOUT.items():
        value, local = getattr(batch, name), getattr(like, name)
        if f.kind not in (ROW_LIST, WHOLE) and value is not None and local is not None:
            setattr(batch, name, value.to(local.device))
    return batch


__all__ = ["filter_groups", "share_varied"]
