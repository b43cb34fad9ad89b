"""The actor's sequence-parallel group (`actor.sequence_parallel_size`) as one data-parallel replica.

The rest of the step is untouched: every actor rank samples, scores and holds its own rows. Only the
forwards of the models that split sequences change (the policy, and a reference, critic or teacher on its
ranks). Before each such pass the S ranks of a group pool their rows (`pool_rows`: every member gets the
same rows in the same order), so each micro-batch can be split over them
(`forward.sequence_parallel_logprobs`, `sequence_parallel_values`); the results of a rank's own rows are
cut back out (`own_rows`). The update runs over the pooled rows with the batch plan of W/S data-parallel replicas
(`group_plan`) and with `replicas=S`, which makes FSDP's average over all W ranks the sum over each group's
partial gradients (`update.micro_weights`). The shuffle stream is seeded the same on every rank, so the
members of a group cut the same mini- and micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from verl.batch import LAYOUT, PROMPT, RESPONSE, ROW, RolloutBatch, padding
from verl.config.schema import OptimConfig
from verl.distributed.guard import CollectiveGuard, role_key
from verl.distributed.sequence_parallel import ATTENTION_NAME, SequenceParallel
from verl.distributed.transfer import all_gather_batch, pad_to_group_width
from verl.models.lora import base_of
from verl.trainer.forward.batch_math import BatchPlan, plan_batches

_POOLED_KINDS = (ROW, PROMPT, RESPONSE)


@dataclass(frozen=True)
class Pooled:
    """A group's pooled rows and where this rank's own rows sit in them."""

    batch: RolloutBatch
    start: int
    count: int
    response_width: int  # this rank's batch's, to cut results back to

    def own_rows(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a [pooled rows, R, ...] result, at its own batch's response width."""
        return values[self.start : self.start + self.count, : self.response_width]


def pool_rows(batch: RolloutBatch, sp: SequenceParallel, guard: CollectiveGuard, *, pad_token_id: int | None,
              device: torch.device, stage: str) -> Pooled:
    """The rows of every rank of `sp`, in rank order, on each of them (the per-row tensor fields; the
    prompt rows, texts and metrics stay with their rank). Widths are padded to the group's widest first."""
    fields = {name: getattr(batch, name) for name, f in LAYOUT.items()
              if f.kind in _POOLED_KINDS and isinstance(getattr(batch, name), torch.Tensor)}
    sides = padding([k for k in fields if LAYOUT[k].kind != ROW], pad_token_id)

    def widest(t: torch.Tensor) -> torch.Tensor:  # behind the arrival check, as every collective between stages
        guard.run(f"{stage}:width", sp.ranks, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=sp.group),
                  group_name=role_key(sp.ranks))
        return t

    fields |= pad_to_group_width({k: fields[k] for k in sides}, sides, all_reduce_max=widest, device=device)
    bools = {k for k, t in fields.items() if t.dtype == torch.bool}  # sent as bytes: not every backend has bool
    sent = {k: t.to(torch.uint8) if k in bools else t for k, t in fields.items()}
    pooled, sizes = all_gather_batch(sent, group=sp.group, ranks=sp.ranks, guard=guard, stage=stage, device=device)
    pooled = {k: t.to(batch.prompt_ids.device) for k, t in pooled.items()}
    pooled = {k: t.bool() if k in bools else t for k, t in pooled.items()}
    return Pooled(RolloutBatch.from_fields(pooled), sum(sizes[: sp.index]), sizes[sp.index],
                  batch.response_ids.shape[1])


def splits_sequences(model: torch.nn.Module) -> bool:
    """Whether `model`'s attention was made sequence-parallel (`enable_sequence_parallel`)."""
    return any(getattr(getattr(m, "config", None), "_attn_implementation", None) == ATTENTION_NAME
               for m in base_of(model).modules())


def group_plan(plan: BatchPlan, cfg: OptimConfig, size: int) -> BatchPlan:
    """`plan` (per actor rank) for the pooled rows of `size`-rank groups: W/S replicas, each with S ranks'
    rows per mini-batch; `micro_batch_size` rows per micro-batch, packed into one row without padding and
    split over the group (so a token budget counts real tokens)."""
    if size == 1:
        return plan
    n = plan.sequences_per_step // plan.prompts_per_step
    return replace(plan_batches(plan.prompts_per_step, n, cfg, plan.dp_size // size), packed=True)


@dataclass(frozen=True)
class ActorSequenceParallel:
    """What the RL trainer asks of the actor's group: whether a model's forwards split sequences (the
    policy's only), the pooled rows of a stage, and the actor's batch plan over them."""

    sp: SequenceParallel | None  # None: no group (a single process, or not an actor rank)
    guard: CollectiveGuard | None
    pad_token_id: int | None
    device: torch.device

    @property
    def size(self) -> int:
        return self.sp.size if self.sp is not None else 1

    def splits(self, model: torch.nn.Module | None, policy: torch.nn.Module | None) -> bool:
        """Whether `model`'s forwards split sequences over the group: the policy's, and a reference's, critic's
        or teacher's on the same ranks (made sequence-parallel at start-up; a LoRA reference is the policy
        with its adapters off)."""
        return self.size > 1 and model is not None and (model is policy or splits_sequences(model))

    def pool(self, batch: RolloutBatch, stage: str) -> Pooled:
        return pool_rows(batch, self.sp, self.guard, pad_token_id=self.pad_token_id, device=self.device,
                         stage=f"sequence_parallel:{stage}")

    def plan(self, plan: BatchPlan, cfg: OptimConfig) -> BatchPlan:
        return group_plan(plan, cfg, self.size)

    def own_rows_of(self, split: bool, batch: RolloutBatch, stage: str,
                    fn: Callable[[RolloutBatch], torch.Tensor]) -> torch.Tensor:
        """`fn(batch)`; for a model that `split`s, over the group's pooled rows, this rank's cut back out."""
        if not split:
            return fn(batch)
        pooled = self.pool(batch, stage)
        return pooled.own_rows(fn(pooled.batch))

    def update_rows(self, split: bool, batch: RolloutBatch, plan: BatchPlan,
                    cfg: OptimConfig) -> tuple[RolloutBatch, BatchPlan, int]:
        """The rows, batch plan and replica count (`update.optimize`'s `replicas`) of an update: for a model
        that `split`s, the group's pooled rows under the group's plan, each row split over its S ranks."""
        if not split:
            return batch, plan, 1
        return self.pool(batch, "update").batch, self.plan(plan, cfg), self.size


__all__ = ["ActorSequenceParallel", "Pooled", "group_plan", "pool_rows"]
