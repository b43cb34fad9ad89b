"""Workers of the sequence-parallel tests (tests/distributed/test_sequence_parallel.py): gloo on CPU, float32.

Each rank also computes the single-process reference itself (no collectives), so a test compares within one
process what one rank computes alone with what the group computes split."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from _dist_workers import setup

VOCAB = 64
PROMPT, RESPONSE = 6, 10  # 15 forward positions: padded to a multiple of the group size


def tiny(kv_heads: int = 2, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).float()


def rollout_batch(rows: int = 6, seed: int = 3, extra_left: int = 0, extra_right: int = 0):
    """Left-padded prompts and right-padded responses of different lengths, with what a PPO update reads.
    `extra_left`/`extra_right` add padding columns (the same rows, padded wider)."""
    from verl.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, PROMPT + 1, (rows,), generator=g)
    response_len = torch.randint(1, RESPONSE + 1, (rows,), generator=g)
    prompt_len[0], response_len[0] = PROMPT, RESPONSE  # one row fills the width
    prompt_mask = (torch.arange(PROMPT)[None, :] >= PROMPT - prompt_len[:, None]).long()
    response_mask = (torch.arange(RESPONSE)[None, :] < response_len[:, None]).long()
    prompt_ids = torch.randint(1, VOCAB, (rows, PROMPT), generator=g) * prompt_mask
    response_ids = torch.randint(1, VOCAB, (rows, RESPONSE), generator=g) * response_mask
    rand = lambda: torch.randn(rows, RESPONSE, generator=g) * response_mask  # noqa: E731
    left = lambda t: torch.nn.functional.pad(t, (extra_left, 0))  # noqa: E731
    right = lambda t: torch.nn.functional.pad(t, (0, extra_right))  # noqa: E731
    return RolloutBatch(rows=[{} for _ in range(rows)], group_ids=torch.arange(rows) // 2,
                        prompt_ids=left(prompt_ids), prompt_mask=left(prompt_mask), response_ids=right(response_ids),
                        response_mask=right(response_mask), old_logprobs=right(-2.0 + 0.3 * rand()),
                        ref_logprobs=right(-2.0 + 0.3 * rand()), advantages=right(rand()))


def actor_config(**overrides):
    from verl.config.schema import ActorConfig

    return ActorConfig(**{"entropy_coef": 0.01, "kl_loss_coef": 0.1, "micro_batch_size": 2, "grad_clip": None,
                          "shuffle": False, **overrides})


def micro_loss(model, cfg, sp, temperature: float = 0.7, chunked: bool = False):
    from verl.trainer.forward.logprobs import logprobs_of
    from verl.trainer.rl import update

    return update.policy_loss(cfg, RESPONSE, lambda mb: logprobs_of(
        model, mb, share=False, temperature=temperature, with_entropy=True, sp=sp, chunked=chunked))


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _sp(rank: int, world: int):
    from verl.distributed.sequence_parallel import SequenceParallel

    return SequenceParallel(dist.group.WORLD, tuple(range(world)), rank)


# --------------------------------------------------------------------------------------------------
def forward_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Log-probs, entropy, loss and summed gradients of the split forward against one rank's whole forward:
    sdpa and eager attention, KV heads divisible by the group and fewer than it (repeated), activation
    checkpointing (the recomputation all-to-alls again), the chunked head (log-probs and entropy from the head's
    input), and the same rows padded wider."""
    from verl.distributed.fsdp import checkpoint_decoder_layers
    from verl.distributed.sequence_parallel import enable_sequence_parallel
    from verl.trainer.forward.logprobs import logprobs_of

    setup(rank, world, port)
    sp = _sp(rank, world)
    out = {}
    batch = rollout_batch()
    # a multi-turn episode's observation inside the first response: attended, not in the loss
    batch.response_attention_mask = batch.response_mask.clone()
    batch.response_mask[0, 3:6] = 0
    out["masks"] = (batch.response_mask, batch.response_attention_mask)
    for name, kv, attn, ckpt in [("sdpa_kv2", 2, "sdpa", False), ("eager_kv1", 1, "eager", False),
                                 ("sdpa_kv2_ckpt", 2, "sdpa", True), ("sdpa_kv2_chunked", 2, "sdpa", False)]:
        chunked = name.endswith("chunked")
        reference, split = tiny(kv, attn), tiny(kv, attn)
        assert enable_sequence_parallel(split, world) == 2
        if ckpt:
            checkpoint_decoder_layers(split)
        cfg = actor_config()
        ref_loss, ref_metrics = micro_loss(reference, cfg, None)(batch)
        ref_loss.backward()
        loss, metrics = micro_loss(split, cfg, sp, chunked=chunked)(batch)
        loss.backward()
        summed = grads(split)
        for t in summed.values():
            dist.all_reduce(t)
        with torch.no_grad():
            lp, ent = logprobs_of(split, batch, share=False, temperature=0.7, with_entropy=True, sp=sp,
                                  chunked=chunked)
            ref_lp, ref_ent = logprobs_of(reference, batch, share=False, temperature=0.7, with_entropy=True)
        out[name] = {"loss": (float(loss), float(ref_loss)), "grads": (summed, grads(reference)),
                     "logprobs": (lp, ref_lp), "entropy": (ent, ref_ent),
                     "metrics": ({k: float(v) for k, v in metrics.items()},
                                 {k: float(v) for k, v in ref_metrics.items()})}
    # the same rows with 3 more padding columns on the left of the prompts and 4 on the right of the responses
    model = tiny()
    enable_sequence_parallel(model, world)
    with torch.no_grad():
        narrow = logprobs_of(model, batch, share=False, temperature=0.7, sp=sp)[0]
        wide = logprobs_of(model, rollout_batch(extra_left=3, extra_right=4), share=False, temperature=0.7, sp=sp)[0]
        plain = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                      position_ids=batch.position_ids).logits  # without the keyword: the original attention
        before = tiny()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=batch.position_ids).logits
    out["padding"] = (narrow, wide)
    out["fallback"] = (plain, before)
    torch.save(out, Path(out_dir) / f"forward{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
def optimize_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """`update.optimize` with FSDP2 over the ranks and sequence-parallel groups of 2 (`size` = world: one
    data-parallel replica; world 4: two), each rank starting from its own rows pooled over its group, against
    one process optimizing all rows: same weights after the step and same metrics, for micro-batches of 2 rows
    and for a token budget."""
    from verl.config.fsdp import FSDPConfig
    from verl.distributed import RoleGroups
    from verl.distributed.fsdp import apply_fsdp, full_state_dict
    from verl.distributed.mapping import validate_device_mapping
    from verl.distributed.placement import Placement
    from verl.distributed.sequence_parallel import enable_sequence_parallel
    from verl.trainer.forward.batch_math import plan_batches
    from verl.trainer.forward.sequence_parallel import group_plan, pool_rows
    from verl.trainer.rl import update

    setup(rank, world, port)
    size = 2
    mapping = validate_device_mapping(None, world_size=world, algorithm_needs_critic=False, needs_ref=False,
                                      needs_reward_model=False, role_dtypes={"actor": "float32"},
                                      visible_devices=None, cuda_visible_devices=None)
    groups = RoleGroups.create(mapping, timeout_s=60, sequence_parallel=size)
    sp = groups.sequence_parallel()
    placement = Placement(groups, rank=rank, world_size=world)
    full = rollout_batch(rows=8)
    mine = full.select(torch.arange(rank * 8 // world, (rank + 1) * 8 // world))  # this rank's rows
    record: dict[str, object] = {"sp_ranks": sp.ranks}

    def step(module, optimizer, grad_clip, scheduler):
        optimizer.step()
        scheduler.step()
        return 0.0

    for name, options in [("micro", {}), ("budget", {"max_tokens_per_micro_batch": 40}),
                          ("seq_mean", {"loss_agg": "seq-mean-token-mean", "micro_batch_size": 3})]:
        cfg = actor_config(**options)
        reference = tiny()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda _: 1.0)
        # the same micro-batches: the split forwards pack their rows, so a token budget counts real tokens
        whole = dataclasses.replace(plan_batches(8, 1, cfg, 1), packed=True)
        ref_metrics = update.optimize(reference, ref_opt, sched, full, cfg, whole,
                                      micro_loss(reference, cfg, None), placement=Placement(None),
                                      clip_and_step=step, prefix="actor")
        model = tiny()
        enable_sequence_parallel(model, size)
        apply_fsdp(model, FSDPConfig(), mesh=groups.mesh("actor"))
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        pooled = pool_rows(mine, sp, groups.guard, pad_token_id=0, device=torch.device("cpu"), stage="test")
        plan = group_plan(plan_batches(8, 1, cfg, world), cfg, size)
        metrics = update.optimize(model, opt, sched, pooled.batch, cfg, plan, micro_loss(model, cfg, sp),
                                  placement=placement, clip_and_step=step, prefix="actor", replicas=size)
        state = full_state_dict(model)
        record[name] = {"state": (state, reference.state_dict()), "metrics": (metrics, ref_metrics),
                        "pooled_rows": len(pooled.batch), "own": (pooled.start, pooled.count)}
    if rank in (0, world - 1):
        torch.save(record, Path(out_dir) / f"optimize{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def pool_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """`pool_rows` over uneven shards (3 rows with 4 prompt columns, 2 rows with 6): every rank gets the same
    pooled rows, padded on the right side of each field, and its own rows back out of a result."""
    from verl.distributed import RoleGroups
    from verl.distributed.mapping import validate_device_mapping
    from verl.trainer.forward.sequence_parallel import pool_rows

    setup(rank, world, port)
    mapping = validate_device_mapping(None, world_size=world, algorithm_needs_critic=False, needs_ref=False,
                                      needs_reward_model=False, role_dtypes={"actor": "float32"},
                                      visible_devices=None, cuda_visible_devices=None)
    groups = RoleGroups.create(mapping, timeout_s=60, sequence_parallel=world)
    full = rollout_batch(rows=5)
    full.finished = torch.tensor([True, False, True, True, False])
    mine = full.select(torch.arange(2, 5) if rank == 0 else torch.arange(0, 2))
    if rank == 0:  # shorter rows, in narrower fields: the pooling pads them back to the group's width
        mine.prompt_mask[:, :2] = 0
        mine.prompt_ids[:, :2] = 0
        mine.prompt_ids, mine.prompt_mask = mine.prompt_ids[:, 2:], mine.prompt_mask[:, 2:]
        for name in ("response_ids", "response_mask", "old_logprobs", "ref_logprobs", "advantages"):
            value = getattr(mine, name)
            value[:, 8:] = 0
            setattr(mine, name, value[:, :8])
    pooled = pool_rows(mine, groups.sequence_parallel(), groups.guard, pad_token_id=0, device=torch.device("cpu"),
                       stage="test")
    fields = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "advantages", "group_ids", "finished")
    torch.save({"pooled": {k: getattr(pooled.batch, k) for k in fields}, "mine": {k: getattr(mine, k) for k in fields},
                "own": pooled.own_rows(pooled.batch.advantages)}, Path(out_dir) / f"pool{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def sft_batch(rows: int = 5, seed: int = 4) -> dict:
    """SFT/DPO micro-batch rows as `collate_sequences` lays them out (left-padded, next-token targets), of
    different lengths, the loss on each row's last tokens (one row's target tokens interrupted, as a
    multi-turn row's observation is)."""
    from verl.data.datasets import IGNORE_INDEX
    from verl.trainer.offline.sft_trainer import collate_sequences, shifted_targets

    g = torch.Generator().manual_seed(seed)
    items = []
    for r in range(rows):
        n = PROMPT + RESPONSE if r == 0 else int(torch.randint(3, PROMPT + RESPONSE + 1, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        start = int(torch.randint(1, n - 1, (1,), generator=g))
        labels = [IGNORE_INDEX] * start + ids[start:]
        if r == 0:
            labels[start + 1 : start + 3] = [IGNORE_INDEX] * 2
        items.append([(ids, shifted_targets(labels))])
    return collate_sequences(items, 0, packed=False)


def target_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """SFT/DPO's `target_logprobs` split over the group against one rank's whole rows: the per-target
    log-probs, and the gradients of a loss that weighs every target differently (summed over the ranks), with
    the plain head and the chunked one, and for a row with one target (on one rank only)."""
    from verl.data.datasets import IGNORE_INDEX
    from verl.distributed.sequence_parallel import enable_sequence_parallel
    from verl.trainer.offline.sft_trainer import collate_sequences, shifted_targets, target_logprobs

    setup(rank, world, port)
    sp = _sp(rank, world)
    ids = list(range(1, 8))  # one target token: the ranks but one have nothing to score
    lone = collate_sequences([[(ids, shifted_targets([IGNORE_INDEX] * 6 + ids[6:]))]], 0, packed=False)
    out = {}
    for chunked, batch in ((False, sft_batch()), (True, sft_batch()), ("lone", lone)):
        reference, split = tiny(), tiny()
        enable_sequence_parallel(split, world)
        chunked = chunked is True
        want, want_rows = target_logprobs(reference, batch, torch.device("cpu"), chunked)
        got, rows = target_logprobs(split, batch, torch.device("cpu"), chunked, sp)
        weights = torch.linspace(0.5, 2.0, len(want))
        (want * weights).sum().backward()
        (got * weights).sum().backward()
        summed = grads(split)
        for t in summed.values():
            dist.all_reduce(t)
        out[len(out)] = {"logprobs": (got.detach(), want.detach()), "rows": (rows, want_rows),
                         "grads": (summed, grads(reference))}
    torch.save(out, Path(out_dir) / f"target{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def critic_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """The critic's values and clipped value loss split over the group against one rank's whole rows: values
    at the attended response positions (a multi-turn observation among them), the loss, and the gradients
    summed over the ranks, backbone and value head."""
    from verl.config.schema import CriticConfig
    from verl.distributed.sequence_parallel import enable_sequence_parallel
    from verl.models.critic import ValueModel
    from verl.trainer.forward.logprobs import values_of
    from verl.trainer.rl import update

    setup(rank, world, port)
    sp = _sp(rank, world)
    batch = rollout_batch()
    batch.response_attention_mask = batch.response_mask.clone()
    batch.response_mask[0, 3:6] = 0
    g = torch.Generator().manual_seed(5)
    batch.values = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    batch.returns = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    reference, split = ValueModel.from_actor(tiny()), ValueModel.from_actor(tiny())
    head = torch.randn(reference.value_head.weight.shape, generator=g)  # a trained head (a fresh one is 0)
    for m in (reference, split):
        m.value_head.weight.data.copy_(head)
    assert enable_sequence_parallel(split, world) == 2
    cfg = CriticConfig(value_clip=0.2)
    ref_loss, _ = update.critic_loss(cfg, RESPONSE, lambda mb: values_of(reference, mb, share=False))(batch)
    ref_loss.backward()
    loss, _ = update.critic_loss(cfg, RESPONSE, lambda mb: values_of(split, mb, share=False, sp=sp))(batch)
    loss.backward()
    summed = grads(split)
    for t in summed.values():
        dist.all_reduce(t)
    with torch.no_grad():
        values = (values_of(split, batch, share=False, sp=sp), values_of(reference, batch, share=False))
    torch.save({"loss": (float(loss), float(ref_loss)), "grads": (summed, grads(reference)), "values": values,
                "attended": batch.response_attention_mask.bool()}, Path(out_dir) / f"critic{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


__all__ = ["critic_worker", "forward_worker", "optimize_worker", "pool_worker", "sft_batch", "target_worker"]
