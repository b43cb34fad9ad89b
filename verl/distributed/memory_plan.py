"""Per-GPU memory plan of a run: its start-up (the models loading, before the first step) and a training
step's rollout phase and update phase, part by part (an SFT or DPO step has the update phase only); for an
asynchronous run, also a rollout rank's (`devices.rollout`: ranks that only generate).

`verl.distributed.memory` counts model state (weights, gradients, optimizer moments) per rank; this adds
what a step needs on top on a rank that holds the actor: FSDP2's gathered layers and unsharded gradients,
activations (with and without activation checkpointing, kept on the device or offloaded to host memory, split
over sequence-parallel ranks), the response logits and their gradient (or, with chunked log-probs, one chunk
of them at a time), and the rollout engine (colocated vLLM's `gpu_memory_utilization` share of the device, or our
sampler's gathered weights and KV cache). It is arithmetic on the model's shape and the config, so `verl check` prints
it on a machine without a GPU, and it says which settings make a plan that does not fit fit.

Activations are counted tensor by tensor for a Llama/Qwen-style decoder layer (RMSNorm, GQA attention with
a fused kernel that keeps no [T, T] scores, SwiGLU MLP), as Hugging Face's implementation saves them for
backward. Constants that are assumptions, not derivations, are named in `verl.distributed.memory_plan_types`
(`CUDA_RUNTIME_BYTES`, `VLLM_ASLEEP_BYTES`); nothing here has been compared with a measured GPU run yet.
"""

from __future__ import annotations

import dataclasses
import math

from verl.distributed.memory_plan_micro_batch import (
    CHUNKED_AUTO_LOGITS,
    activation_bytes_per_token,
    chunks_logits,
    forward_backward_parts,
    micro_batch_tokens,
    offloaded_activation_bytes,
)
from verl.distributed.memory_plan_startup import sharded_startup_peak, startup_moments, startup_notes
from verl.distributed.memory_plan_types import (
    CUDA_RUNTIME_BYTES,
    GIB,
    VLLM_ASLEEP_BYTES,
    MemoryPlan,
    ModelShape,
    PlanInputs,
    RolloutRank,
)


def plan_memory(x: PlanInputs, device_bytes: int | None) -> MemoryPlan:
    """The rollout and update phases' parts on an actor rank (see the module docstring for what counts)."""
    s, c, m = x.shape, x.compute_bytes, x.master_bytes
    notes: list[str] = []
    offload = x.cpu_offload

    def state(role: str, which: tuple[int, ...]) -> int:
        parts = x.resident.get(role)
        off = role in x.offloaded or (offload and role not in x.kept)
        return 0 if parts is None or off else sum(parts[k] for k in which)

    roles = {"actor": "actor", "ref": "reference", "teacher": "teacher", "critic": "critic", "reward": "reward model"}
    resident_update = [(f"{roles[r]} weights + grads + optimizer (sharded)" if r in ("actor", "critic") else
                        f"{roles[r]} weights (sharded)", state(r, (0, 1, 2))) for r in roles if r in x.resident]
    resident_rollout = [(f"{roles[r]} weights + optimizer (sharded; grads freed)" if r in ("actor", "critic") else
                         f"{roles[r]} weights (sharded)", state(r, (0, 2))) for r in roles if r in x.resident]
    if offload:
        notes.append("fsdp.cpu_offload: sharded weights, gradients and optimizer moments live in host memory")
    elif x.offloaded & set(x.resident):
        notes.append(f"{', '.join(sorted(x.offloaded & set(x.resident)))}.cpu_offload: that state lives in host "
                     "memory")

    t = max(x.tensor_parallel, 1)
    split = f" (1/{t}: tensor-parallel)" if t > 1 else ""
    update = [*resident_update]
    if x.sharded:
        # FSDP2 keeps its root unit (embeddings, final norm, head) gathered from forward to backward, and its
        # gradient unsharded until the backward ends; each layer is gathered (with one prefetched) in turn.
        # With tensor parallelism FSDP2 gathers over the data-parallel replicas: a rank's tensor-parallel part.
        update += [(f"gathered: root (embeddings, head) + 2 layers{split}",
                    (s.root_params + 2 * s.layer_params) * c // t),
                   (f"unsharded gradients: root + 1 layer{split}", (s.root_params + s.layer_params) * c // t)]
    update += forward_backward_parts(x, notes)
    update.append(("CUDA context, NCCL buffers (assumed)", CUDA_RUNTIME_BYTES))
    if not x.samples:
        return _complete(x, [], update, device_bytes, notes)
    rollout = list(resident_rollout)
    if x.engine == "vllm" and x.vllm_colocated:
        update.insert(-1, ("vLLM asleep (KV cache and weights released)", VLLM_ASLEEP_BYTES))
        rollout.append(("weight push: one full tensor at a time (largest)",
                        max(s.embed_params, s.head_params, 1) * m))
        if device_bytes is not None:
            budget = int(x.gpu_memory_utilization * device_bytes)
            weights = _vllm_weights(x)
            if weights <= budget:
                rollout.append((f"vLLM: gpu_memory_utilization {x.gpu_memory_utilization:g} x device", budget))
            else:  # vLLM refuses to start: no room for a KV cache
                rollout.append((f"vLLM: its weights alone, over its gpu_memory_utilization share{split}", weights))
            room = budget - weights
            need = x.rows_per_rank * (x.prompt_len + x.response_len) * s.layers * 2 * s.kv_dim * c // t
            notes.append(f"vLLM's share holds its weights ({weights / GIB:.1f} GiB{split}) and about "
                         f"{max(room, 0) / GIB:.1f} GiB of KV cache and activations; all {x.rows_per_rank} rows "
                         f"of this rank at full length need {need / GIB:.1f} GiB of KV cache"
                         + ("" if room >= need else " (vLLM runs them in waves: slower, not out of memory)"))
        else:
            notes.append(f"vLLM takes rollout.vllm.gpu_memory_utilization={x.gpu_memory_utilization:g} of the "
                         "device, unknown here")
    elif x.engine == "vllm":
        notes.append("vLLM runs on ranks of its own: its share of those devices is not on the actor's")
    else:
        rows = x.rows_per_rank
        rollout.append((f"sampler: gathered policy weights{split}", s.total_params * c // t))
        rollout.append((f"sampler: KV cache ({rows} rows x {x.prompt_len + x.response_len} tokens){split}",
                        rows * (x.prompt_len + x.response_len) * s.layers * 2 * s.kv_dim * c // t))
        rollout.append((f"sampler: next-token logits (float32){split}", rows * s.vocab * 4 // t))
    rollout.append(("CUDA context, NCCL buffers (assumed)", CUDA_RUNTIME_BYTES))
    return _complete(x, rollout, update, device_bytes, notes)


def _complete(x: PlanInputs, rollout: list[tuple[str, int]], update: list[tuple[str, int]],
              device_bytes: int | None, notes: list[str]) -> MemoryPlan:
    """The step's phases with the start-up's peak moment and, for an asynchronous run, a rollout rank's plan."""
    moment, startup = max(startup_moments(x, device_bytes), key=lambda m: sum(b for _, b in m[1]))
    notes = [*startup_notes(x), *notes]
    if x.rollout_rank is None:
        return MemoryPlan(inputs=x, rollout=rollout, update=update, device_bytes=device_bytes, notes=notes,
                          startup=startup, startup_moment=moment)
    rank_startup, rank_generating, rank_notes = rollout_rank_parts(x, device_bytes)
    return MemoryPlan(inputs=x, rollout=rollout, update=update, device_bytes=device_bytes, notes=notes,
                      startup=startup, startup_moment=moment, rollout_rank_startup=rank_startup,
                      rollout_rank=rank_generating, rollout_rank_notes=rank_notes)


def rollout_rank_parts(x: PlanInputs, device_bytes: int | None
                       ) -> tuple[list[tuple[str, int]], list[tuple[str, int]], list[str]]:
    """(start-up, generating, notes) of a rollout rank (`RolloutRank`): it loads the whole policy first; vLLM
    then gets the device (the policy moved to the CPU) and stays awake, or our sampler generates from that
    copy with its KV cache; every weight delivery lands in a bucket on the device (at most
    `bucket_bytes`, or one tensor larger than that) before it is written into the weights."""
    r, s = x.rollout_rank, x.shape
    assert r is not None
    ctx = ("CUDA context, NCCL buffers (assumed)", CUDA_RUNTIME_BYTES)
    startup = [("policy weights: loaded whole (master dtype; a rollout rank is not sharded)", r.weights_bytes), ctx]
    largest = max(s.embed_params, s.head_params, s.intermediate * s.hidden)
    bucket = ("weight delivery: one bucket (64 MiB, or the largest tensor)",
              max(r.bucket_bytes, largest * r.wire_bytes))
    seq = x.prompt_len + x.response_len
    notes: list[str] = []
    if r.engine == "vllm":
        if device_bytes is None:
            generating = [bucket, ctx]
            notes.append(f"vLLM takes rollout.vllm.gpu_memory_utilization={r.gpu_memory_utilization:g} of the "
                         "device, unknown here")
        else:
            budget = int(r.gpu_memory_utilization * device_bytes)
            generating = [(f"vLLM (awake): gpu_memory_utilization {r.gpu_memory_utilization:g} x device", budget),
                          bucket, ctx]
            room = budget - s.total_params * r.wire_bytes
            need = r.rows * seq * s.layers * 2 * s.kv_dim * r.wire_bytes
            notes.append(f"the policy moves to the CPU before vLLM starts; vLLM's share holds its weights "
                         f"({s.total_params * r.wire_bytes / GIB:.1f} GiB) and about {max(room, 0) / GIB:.1f} GiB "
                         f"of KV cache; all {r.rows} rows of this rank at full length need {need / GIB:.1f} GiB"
                         + ("" if room >= need else " (vLLM runs them in waves: slower, not out of memory)"))
    else:
        w = r.weight_bytes_per_element
        generating = [("policy weights: whole (master dtype)", r.weights_bytes),
                      (f"sampler: KV cache ({r.rows} rows x {seq} tokens)", r.rows * seq * s.layers * 2 * s.kv_dim * w),
                      ("sampler: next-token logits (float32)", r.rows * s.vocab * 4), bucket, ctx]
    return startup, generating, notes


def _vllm_weights(x: PlanInputs) -> int:
    """What vLLM's weights take of its share on one rank: its tensor-parallel part."""
    return x.shape.total_params * x.compute_bytes // max(x.tensor_parallel, 1)


def _micro_batch_fit(x: PlanInputs, device_bytes: int) -> int | None:
    """The largest micro-batch (sequences) whose update phase fits, or None if not even one does."""
    best = None
    for b in range(1, max(x.micro_batch, 1) + 1):
        if plan_memory(x.with_(micro_batch=b, tokens_per_micro_batch=None), device_bytes).update_peak <= device_bytes:
            best = b
    return best


def _startup_advice(x: PlanInputs, plan: MemoryPlan, device_bytes: int,
                    fixes: list[tuple[str, dict[str, object]]]) -> list[str]:
    """What makes a start-up that does not fit fit: a smaller vLLM share where vLLM's start is its peak (added to
    `fixes`); where whole models are loaded first, what reading each rank's shards would hold instead."""
    out = []
    if plan.startup_moment == "while vLLM starts" and plan.rollout_peak <= device_bytes:
        budget = int(x.gpu_memory_utilization * device_bytes)
        util = math.floor(20 * (device_bytes - (plan.startup_peak - budget)) / device_bytes) / 20
        if util * device_bytes > _vllm_weights(x):
            fixes.append((f"rollout.vllm.gpu_memory_utilization={util:g}", {"gpu_memory_utilization": util}))
    if not x.reads_shards:
        ranks, where = None, "over the ranks each role has here"
        if x.world_size <= 1:  # one process: the smallest launch whose ranks, each reading its shards, fit
            ranks = next((n for n in (2, 4, 8, 16, 32, 64)
                          if sharded_startup_peak(x, n, device_bytes) <= device_bytes), 64)
            where = f"on {ranks} GPUs (--nproc {ranks})"
        peak = sharded_startup_peak(x, ranks, device_bytes)
        out.append(f"start-up: whole models before sharding hold {plan.startup_peak / GIB:.1f} GiB, because of "
                   f"{x.whole_reason or 'a whole load'}; each rank reading only its shards {where} would hold "
                   f"{peak / GIB:.1f} GiB ({'fits' if peak <= device_bytes else 'still does not fit'})")
    return out


def _rollout_rank_advice(x: PlanInputs, plan: MemoryPlan, device_bytes: int) -> list[str]:
    """Why a rollout rank does not fit, and the vLLM share that would fit where that is the cause."""
    r = x.rollout_rank
    assert r is not None
    out = []
    loading = sum(b for _, b in plan.rollout_rank_startup)
    if loading > device_bytes:
        out.append(f"rollout rank: loading the whole policy ({r.weights_bytes / GIB:.1f} GiB in the master dtype) "
                   f"does not fit the GPU, and no setting shards a rollout rank's copy")
    generating = sum(b for _, b in plan.rollout_rank)
    if generating > device_bytes and r.engine == "vllm":
        rest = generating - int(r.gpu_memory_utilization * device_bytes)
        util = math.floor(20 * (device_bytes - rest) / device_bytes) / 20
        y = x.with_(rollout_rank=dataclasses.replace(r, gpu_memory_utilization=util))
        out.append(f"rollout rank: rollout.vllm.gpu_memory_utilization={util:g}: generating "
                   f"{sum(b for _, b in plan_memory(y, device_bytes).rollout_rank) / GIB:.1f} GiB")
    elif generating > device_bytes:
        out.append(f"rollout rank: our sampler's whole policy and KV cache need {generating / GIB:.1f} GiB; fewer "
                   "rows per rollout rank (more devices.rollout ranks) shrink the KV cache")
    return out


def _tensor_parallel_fix(x: PlanInputs, device_bytes: int) -> tuple[str, PlanInputs] | None:
    """(keys, inputs) of the smallest tensor-parallel size whose plan fits (with activation checkpointing where
    it needs it too); else the largest size the run allows, which still does not fit; None without one."""
    for checkpointing in sorted({x.activation_checkpointing, True}):
        for size in x.tensor_parallel_sizes:
            y = x.with_tensor_parallel(size).with_(activation_checkpointing=checkpointing)
            if plan_memory(y, device_bytes).fits or (checkpointing and size == x.tensor_parallel_sizes[-1]):
                keys = [f"actor.tensor_parallel_size={size}", *x.tensor_parallel_keys]
                if checkpointing and not x.activation_checkpointing:
                    keys.append("fsdp.activation_checkpointing=true")
                return ", ".join(keys), y
    return None


def suggestions(x: PlanInputs, device_bytes: int) -> list[str]:
    """Settings that make a plan fit, each with its peaks: one change at a time first, then combinations.
    Empty when the plan fits as it is."""
    plan = plan_memory(x, device_bytes)
    if plan.fits:
        return []
    out: list[str] = []

    def describe(keys: str, y: PlanInputs) -> str:
        p = plan_memory(y, device_bytes)
        verdict = "fits" if p.fits else "still does not fit"
        host = f"; {offloaded_activation_bytes(y) / GIB:.1f} GiB of host memory" if y.activation_offload else ""
        return (f"{keys}: rollout {p.rollout_peak / GIB:.1f} GiB, update {p.update_peak / GIB:.1f} GiB, start-up "
                f"{p.startup_peak / GIB:.1f} GiB ({verdict}{host})")

    fixes: list[tuple[str, dict[str, object]]] = []  # (keys, changes) in the order worth trying
    if plan.update_peak > device_bytes:
        if not x.chunked_logprobs:
            fixes.append(("actor.chunked_logprobs=true", {"chunked_logprobs": True}))
        if not x.activation_checkpointing:
            fixes.append(("fsdp.activation_checkpointing=true", {"activation_checkpointing": True}))
        for ckpt in sorted({x.activation_checkpointing, True}):
            b = _micro_batch_fit(x.with_(activation_checkpointing=ckpt), device_bytes)
            if b is not None and (b < x.micro_batch or x.tokens_per_micro_batch is not None):
                keys = (f"{'fsdp.activation_checkpointing=true, ' if ckpt and not x.activation_checkpointing else ''}"
                        f"actor.micro_batch_size={b}"
                        + (", actor.max_tokens_per_micro_batch=null" if x.tokens_per_micro_batch else ""))
                fixes.append((keys, {"activation_checkpointing": ckpt, "micro_batch": b,
                                     "tokens_per_micro_batch": None}))
    if plan.rollout_peak > device_bytes and x.engine == "vllm" and x.vllm_colocated:
        rest = plan.rollout_peak - int(x.gpu_memory_utilization * device_bytes)
        util = math.floor(20 * (device_bytes - rest) / device_bytes) / 20  # a multiple of 0.05 that fits
        weights = _vllm_weights(x)
        if util * device_bytes > weights:
            fixes.append((f"rollout.vllm.gpu_memory_utilization={util:g}", {"gpu_memory_utilization": util}))
        else:
            out.append(f"rollout.vllm.gpu_memory_utilization: the trainer's resident state leaves "
                       f"{(device_bytes - rest) / GIB:.1f} GiB, less than vLLM's weights ({weights / GIB:.1f} GiB)")
    if plan.startup_peak > device_bytes:
        out += _startup_advice(x, plan, device_bytes, fixes)
    if plan.rollout_rank and plan.rollout_rank_peak > device_bytes:
        out += _rollout_rank_advice(x, plan, device_bytes)
    if plan.update_peak > device_bytes and not x.activation_offload:
        fixes.append(("actor.activation_offload=true", {"activation_offload": True}))
    if not x.cpu_offload:
        fixes.append(("fsdp.cpu_offload=true", {"cpu_offload": True}))
    out += [describe(keys, x.with_(**changes)) for keys, changes in fixes]
    split = _tensor_parallel_fix(x, device_bytes)  # the largest change: a run on a 2-D mesh
    if split is not None:
        out.append(describe(*split))
    if plan.update_peak <= device_bytes or plan.rollout_peak <= device_bytes:
        return list(dict.fromkeys(out))
    # both phases over: the first fix of each phase, together
    update_fix = next((f for f in fixes if plan_memory(x.with_(**f[1]), device_bytes).update_peak <= device_bytes),
                      None)
    rollout_fix = next((f for f in fixes if plan_memory(x.with_(**f[1]), device_bytes).rollout_peak <= device_bytes),
                       None)
    if update_fix and rollout_fix and update_fix is not rollout_fix:
        both = x.with_(**{**update_fix[1], **rollout_fix[1]})
        out.append(describe(f"together: {update_fix[0]}, {rollout_fix[0]}", both))
    return list(dict.fromkeys(out))


__all__ = ["CHUNKED_AUTO_LOGITS", "CUDA_RUNTIME_BYTES", "MemoryPlan", "ModelShape", "PlanInputs", "RolloutRank",
           "VLLM_ASLEEP_BYTES", "activation_bytes_per_token", "chunks_logits", "forward_backward_parts",
           "micro_batch_tokens", "offloaded_activation_bytes", "plan_memory", "rollout_rank_parts",
           "sharded_startup_peak", "startup_moments", "startup_notes", "suggestions"]
