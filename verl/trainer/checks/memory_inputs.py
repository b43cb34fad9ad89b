"""A RunConfig as the inputs of the per-GPU memory plan (`verl.distributed.memory_plan`).

The plan is for the GPUs the run targets, so it is built on a machine without one too (`verl check` on a
login node or a laptop): dtypes are resolved for CUDA, the model's shape is read off its config on the
meta device (a folder with config.json alone is enough), and the vLLM share is read from the config.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from verl.config.schema import RunConfig
from verl.distributed.fsdp import find_decoder_layers
from verl.distributed.mapping import DeviceMapping
from verl.distributed.memory import _shard_factor, estimate_memory
from verl.distributed.memory_plan import (
    ModelShape,
    PlanInputs,
    RolloutRank,
    chunks_logits,
    micro_batch_tokens,
)
from verl.models.sharded_load import reads_shards
from verl.models.vision import is_vision_language, vision_tower
from verl.rollout.async_rollout import BUCKET_BYTES
from verl.rollout.engine_check import ROLLOUT_RANK_GPU_MEMORY_UTILIZATION
from verl.trainer.build.fsdp_launch import fsdp_launch
from verl.trainer.build.precision import role_dtype_names
from verl.trainer.checks.lora_checks import meta_causal_lm
from verl.trainer.checks.tensor_parallel_checks import tensor_parallel_problems
from verl.utils.dtype import bytes_per_element


def rollout_rank_memory_utilization(config: RunConfig) -> float:
    """The share of a rollout rank's GPU its vLLM engine takes (`rollout.vllm.rollout_rank_gpu_memory_utilization`,
    or the engine's default there): an upper bound, since vLLM sizes every rank's KV cache by the smallest
    share of its world."""
    return float(config.rollout.vllm.rollout_rank_gpu_memory_utilization or ROLLOUT_RANK_GPU_MEMORY_UTILIZATION)


def vllm_memory_utilization(config: RunConfig) -> float:
    """`rollout.vllm.gpu_memory_utilization` where the config has it, else the vLLM engine's own default."""
    value = getattr(getattr(config.rollout, "vllm", None), "gpu_memory_utilization", None)
    if value is not None:
        return float(value)
    from verl.rollout.vllm_engine import VLLMEngine  # does not import vllm

    return float(inspect.signature(VLLMEngine.__init__).parameters["gpu_memory_utilization"].default)


def targets_gpu(config: RunConfig, device_type: str) -> bool:
    """Whether the run is for GPUs: a GPU is here and not turned off, trainer.device=cuda, or vLLM."""
    if config.trainer.device == "cpu":
        return False
    return device_type == "cuda" or config.trainer.device == "cuda" or config.rollout.engine == "vllm"


def model_shape(config: RunConfig, model_path: str, *, model: Any = None) -> ModelShape | None:
    """The policy's shape from its config (meta device; `model`: one already built), or None where it cannot be
    built here or is not a decoder of the kind the plan models (the plan is advice: its absence stops nothing)."""
    if model is None:
        model = meta_causal_lm(model_path, trust_remote_code=config.model.trust_remote_code,
                               revision=config.model.revision)
    layers = find_decoder_layers(model) if model is not None else []
    if layers and is_vision_language(model):  # its vision blocks are FSDP units too: the shape is the LM's
        tower = set(vision_tower(model)[1].modules())
        layers = [layer for layer in layers if layer not in tower]
    try:
        return ModelShape.from_model(model, layers[0]) if layers else None
    except (AttributeError, TypeError, ValueError):
        return None


def whole_load_reason(config: RunConfig, *, mapping: DeviceMapping | None, world_size: int, kind: str) -> str:
    """Why the trainer's start-up would load its models whole before sharding them, or "" where each rank
    reads only its own shards (`verl.models.sharded_load.reads_shards`, asked with this mapping; then the
    loader's own conditions: safetensors files it can read, no remote code). A folder with config.json alone
    (a plan made away from the weights) is taken to hold safetensors files."""
    if kind != "rl":
        return f"trainer.kind={kind} loads the policy whole"
    split = world_size > 1 and not mapping.is_colocated()
    if not reads_shards(config, world_size=world_size, split=split, actor_ranks=len(mapping.ranks("actor"))):
        if world_size <= 1:
            return "a one-process run"
        if split:
            return "a split placement (devices.* does not put every role on every rank)"
        if len(mapping.ranks("actor")) <= 1:
            return "the actor on one rank"
        return "pretrained adapters (model.lora.path, critic.lora.path) merge into whole models"
    if config.model.trust_remote_code:
        return "remote code (model.trust_remote_code) loads whole"
    folder = Path(config.model.path).expanduser()
    if folder.is_dir() and not any(folder.glob("*.safetensors")) and any(folder.glob("*.bin")):
        return "the weights are .bin files (only safetensors files are read shard by shard)"
    return ""


def plan_inputs(config: RunConfig, *, mapping: DeviceMapping | None, shape: ModelShape, world_size: int,
                counts: dict[str, int] | None = None, trainable: dict[str, int] | None = None,
                kind: str = "rl") -> PlanInputs:
    """The plan's inputs for an actor rank of an RL, SFT or DPO run (`kind`) on CUDA. SFT and DPO have no
    rollout phase; their micro-batch is `actor.micro_batch_size` sequences of data.max_prompt_length +
    data.max_response_length tokens, the response's being the ones whose log-probs are taken.

    Weights, gradients and optimizer moments of trainable roles are in the master dtype (`model.dtype`
    resolved for CUDA); forward and backward in FSDP2's `param_dtype` when `fsdp.mixed_precision` is on;
    frozen roles (reference, reward model) are planned in the compute dtype, sharded over their ranks.
    """
    held = role_dtype_names(config, "cuda", held=True, bf16_supported=True)  # planned for a bf16 GPU
    master = held["actor"] or "float32"
    mixed = config.fsdp.mixed_precision_dtypes("cuda", bf16_supported=True)
    compute = str(mixed[0]).removeprefix("torch.") if mixed else master
    dtypes = {"actor": master, "critic": master,
              **{role: held[role] or compute for role in ("ref", "reward", "teacher")}}
    if counts is None:
        counts = {role: shape.total_params for role in mapping.roles if role != "reward"}
    if kind != "rl":  # the dataset trainers hold no reward model; DPO's precomputed reference is freed
        counts = {role: n for role, n in counts.items()
                  if role == "actor" or (role == "ref" and kind == "dpo" and not config.dpo.precompute_ref)}
    estimate = estimate_memory(counts, dtypes, mapping=mapping,
                               sharding=config.fsdp.sharding_strategy if world_size > 1 else "NO_SHARD",
                               hybrid_shard_size=config.fsdp.hybrid_shard_size, trainable_counts=trainable)
    actor_ranks = mapping.ranks("actor")
    rows = config.data.train_batch_size * config.rollout.n
    a, d = config.actor, config.data
    rl = kind == "rl"
    response_len = config.rollout.max_new_tokens if rl else d.max_response_length
    budget = a.max_tokens_per_micro_batch if rl else None
    tokens, response_tokens = micro_batch_tokens(a.micro_batch_size, budget, d.max_prompt_length, response_len)
    lora = config.model.lora
    launch = fsdp_launch(config, world_size=world_size, device_type="cuda", bf16_supported=True)
    strategy = config.fsdp.sharding_strategy if world_size > 1 and launch.sharded else "NO_SHARD"
    resident = estimate.per_rank[actor_ranks[0]]
    loading = tuple((role, counts[role] * bytes_per_element(dtypes[role] or "float32", where=f"{role} dtype"),
                     _shard_factor(strategy, len(mapping.ranks(role)), config.fsdp.hybrid_shard_size))
                    for role in ("actor", "ref", "teacher", "critic") if role in resident and counts.get(role))
    reason = whole_load_reason(config, mapping=mapping, world_size=world_size, kind=kind)
    master_bytes = bytes_per_element(master, where="model.dtype")
    compute_bytes = bytes_per_element(compute, where="fsdp.mixed_precision.param_dtype")
    rollout_rank = None
    if rl and config.is_async and "rollout" in mapping.roles:
        samplers = len(mapping.ranks("rollout"))
        rollout_rank = RolloutRank(bucket_bytes=BUCKET_BYTES, ranks=samplers,
                                   weights_bytes=shape.total_params * master_bytes,
                                   weight_bytes_per_element=master_bytes, wire_bytes=compute_bytes,
                                   rows=-(-rows // samplers), engine=config.rollout.engine,
                                   gpu_memory_utilization=rollout_rank_memory_utilization(config))
    tp = a.tensor_parallel_size if rl and len(actor_ranks) % a.tensor_parallel_size == 0 else 1
    sizes, keys = tensor_parallel_options(config, shape, kind=kind, actor_ranks=len(actor_ranks), mapping=mapping)
    return PlanInputs(
        shape=shape, resident=resident, compute_bytes=compute_bytes, master_bytes=master_bytes,
        micro_batch=config.actor.micro_batch_size, prompt_len=config.data.max_prompt_length,
        response_len=response_len, tokens_per_micro_batch=budget,
        activation_checkpointing=config.fsdp.activation_checkpointing or config.model.gradient_checkpointing,
        cpu_offload=config.fsdp.cpu_offload, engine=config.rollout.engine,
        offloaded=frozenset(role for role in ("actor", "critic") if getattr(config, role).cpu_offload is True),
        kept=frozenset(role for role in ("actor", "critic") if getattr(config, role).cpu_offload is False),
        activation_offload=a.activation_offload, sequence_parallel=a.sequence_parallel_size,
        # SFT/DPO's `auto` counts every position of a micro-batch (`OfflineTrainer.chunks_logprobs`); tensor
        # parallelism takes the log-probs from each rank's vocabulary shard of the logits instead
        chunked_logprobs=tp == 1 and chunks_logits(a.chunked_logprobs, response_tokens if rl else tokens, shape.vocab),
        head_trained=not lora.enabled or "lm_head" in (lora.modules_to_save or []), sharded=launch.sharded,
        vision_trained=not a.freeze_vision_tower,
        # sdpa gets a [T, T] mask for padded rows; flash-attention, the split forward of sequence parallelism and
        # packed rows (remove_padding, sft.packing: one attention per sequence) build none
        padded_mask=(config.model.attn_implementation != "flash_attention_2" and a.sequence_parallel_size == 1
                     and not (a.remove_padding if rl else kind == "sft" and config.sft.packing)),
        gpu_memory_utilization=vllm_memory_utilization(config), tensor_parallel=tp,
        rows_per_rank=-(-rows // (len(actor_ranks) // tp)),  # a tensor-parallel group samples its replica's rows
        tensor_parallel_sizes=sizes, tensor_parallel_keys=keys,
        samples=rl, loading=loading, reads_shards=not reason, whole_reason=reason, world_size=world_size,
        rollout_rank=rollout_rank)


def tensor_parallel_options(config: RunConfig, shape: ModelShape, *, kind: str, actor_ranks: int,
                            mapping: DeviceMapping | None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The `actor.tensor_parallel_size` values above the run's that its model and actor ranks allow, up to one
    node's 8 GPUs (a group's collectives run on every layer: NVLink, not the network), and the keys the run
    must also change to take one (the packed and chunked forwards are not split yet); none where something else
    it refuses (LoRA, a critic, sequence parallelism...) cannot simply be switched off."""
    if kind != "rl":
        return (), ()
    keys = (("actor.remove_padding=false",) if config.actor.remove_padding else ()) + (
        ("actor.chunked_logprobs=auto",) if config.actor.chunked_logprobs is True else ())
    sizes = []
    for size in (2, 4, 8):
        if size <= config.actor.tensor_parallel_size or actor_ranks % size or any(
                n % size for n in (shape.heads, shape.kv_heads, shape.intermediate, shape.vocab)):
            continue
        actor = config.actor.model_copy(update={"tensor_parallel_size": size, "remove_padding": False,
                                                "chunked_logprobs": "auto"})
        taken = config.model_copy(update={"actor": actor})
        if not tensor_parallel_problems(taken, kind, actor_ranks=actor_ranks, mapping=mapping):
            sizes.append(size)
    return tuple(sizes), keys if sizes else ()


__all__ = ["model_shape", "plan_inputs", "targets_gpu", "tensor_parallel_options", "vllm_memory_utilization",
           "whole_load_reason"]
