"""`actor.tensor_parallel_size`: the start-up check `verl check` and the trainer share, with no weights.

Tensor parallelism splits the actor's layers over T consecutive actor ranks that read the same rows; FSDP2
shards over the actor ranks / T data-parallel replicas (`verl.distributed.tensor_parallel`). What it is not
combined with yet is refused here with the reason and the fix, so a run never starts on half-working code.
"""

from __future__ import annotations

from typing import Any

from verl.config.schema import RunConfig
from verl.distributed.mapping import DeviceMapping
from verl.distributed.tensor_parallel import check_tensor_parallel
from verl.errors import ConfigError, VerlError


def _refusal(key: str, what: str, why: str, fix: str) -> ConfigError:
    """A combination not supported yet: what, why, and the setting that turns it off."""
    return ConfigError(f"actor.tensor_parallel_size={key} with {what}: not combined with tensor parallelism yet: "
                       f"{why}. Fix: {fix}, or set actor.tensor_parallel_size=1")


def tensor_parallel_problems(config: RunConfig, kind: str, *, actor_ranks: int, mapping: DeviceMapping | None,
                             hf_config: Any = None) -> list[VerlError]:
    """Why `actor.tensor_parallel_size` cannot run as configured (empty: it can, or it is 1). `hf_config`: the
    policy's Hugging Face config (None where it cannot be read here: the model check reports that)."""
    tp = config.actor.tensor_parallel_size
    if tp == 1:
        return []
    k = str(tp)
    if kind != "rl":
        return [ConfigError(f"actor.tensor_parallel_size={tp} with trainer.kind={kind}: tensor parallelism is "
                            "implemented for the RL trainer (its actor and reference) only. Fix: set "
                            "actor.tensor_parallel_size=1 (FSDP alone) for SFT, DPO and reward-model training")]
    problems: list[VerlError] = []
    if actor_ranks % tp:
        problems.append(ConfigError(
            f"actor.tensor_parallel_size={tp} does not divide the actor's {actor_ranks} rank(s): each "
            f"tensor-parallel group is {tp} consecutive actor ranks. Fix: launch a multiple of {tp} processes "
            f"(verl train --nproc {tp * max(1, actor_ranks // tp)}), or use a divisor of {actor_ranks}"))
    if hf_config is not None:
        try:
            check_tensor_parallel(getattr(hf_config, "get_text_config", lambda: hf_config)(), tp)
        except ConfigError as exc:
            problems.append(ConfigError(f"actor.tensor_parallel_size={tp}: {exc}"))
    if mapping is not None and not mapping.is_colocated():
        problems.append(_refusal(
            k, "roles on device groups of their own (devices.*)", "every model of the run must sit on the actor's "
            "ranks, where the (data-parallel x tensor-parallel) mesh is built; a reference, critic, teacher, reward "
            "model or rollout on other ranks would need a mesh and a batch transfer of its own",
            "remove devices.ref/critic/teacher/reward/rollout to colocate every role"))
    lora = config.model.lora.enabled
    if lora:
        problems.append(_refusal(k, "LoRA (model.lora)", "the adapters' A/B matrices are not in the "
                                 "tensor-parallel plan", "set model.lora.rank=0 (full fine-tuning)"))
    if config.actor.sequence_parallel_size > 1:
        problems.append(_refusal(k, f"actor.sequence_parallel_size={config.actor.sequence_parallel_size}",
                                 "the Ulysses all-to-all expects every attention head on each rank",
                                 "set actor.sequence_parallel_size=1"))
    if config.actor.remove_padding:
        problems.append(_refusal(k, "packed sequences (actor.remove_padding=true)", "the packed forward's "
                                 "attention probe and head positions run on the whole model", "set "
                                 "actor.remove_padding=false"))
    if config.actor.chunked_logprobs is True:
        problems.append(_refusal(k, "actor.chunked_logprobs=true", "the head's weight is sharded over the "
                                 "vocabulary, and the log-probs are computed from each rank's [tokens, V/T] "
                                 "logits instead", "set actor.chunked_logprobs=auto"))
    if config.offloads("actor") or config.fsdp.cpu_offload:
        problems.append(_refusal(k, "CPU offload (fsdp.cpu_offload / actor.cpu_offload)", "FSDP2's offload "
                                 "policy is not tested over the 2-D mesh", "set fsdp.cpu_offload=false and "
                                 "actor.cpu_offload=false"))
    if config.fsdp.sharding_strategy in ("HYBRID_SHARD", "NO_SHARD"):
        problems.append(_refusal(k, f"fsdp.sharding_strategy={config.fsdp.sharding_strategy}", "FSDP2 shards over "
                                 "the mesh's data-parallel dimension, a 1-D mesh", "set "
                                 "fsdp.sharding_strategy=FULL_SHARD (or SHARD_GRAD_OP)"))
    if config.needs_critic:
        problems.append(_refusal(k, f"a critic (algorithm.adv_estimator={config.algorithm.adv_estimator})",
                                 "the value model is the actor's size but has no tensor-parallel plan (a value "
                                 "head where the vocabulary head was)", "use a critic-free estimator (grpo, rloo, "
                                 "reinforce_plus_plus)"))
    if config.needs_teacher:
        problems.append(_refusal(k, "distillation (algorithm.distill.teacher_path)", "the teacher is loaded "
                                 "whole on every rank, without a tensor-parallel plan", "remove "
                                 "algorithm.distill.teacher_path"))
    if config.env.agent is not None:
        problems.append(_refusal(k, "agent episodes (env.agent)", "concurrent agent calls batch differently on "
                                 "each rank, and every rank of a tensor-parallel group must run the same "
                                 "forwards", "remove env.agent"))
    return problems


def describe_tensor_parallel(config: RunConfig, actor_ranks: int) -> str | None:
    """What `verl check` says the setting does (None when off)."""
    tp = config.actor.tensor_parallel_size
    if tp == 1:
        return None
    dp = max(actor_ranks // tp, 1)
    return (f"tensor parallelism: actor.tensor_parallel_size={tp}: {dp} data-parallel replica(s) x {tp} "
            "tensor-parallel ranks (consecutive actor ranks); the ranks of a group read the same prompts, sample "
            "the same responses and split every layer of the actor (and reference): attention by heads, the MLP "
            "by its intermediate size, the head by the vocabulary (log-probs from the shards); FSDP2 shards over "
            f"the {dp} replica(s)" + ("" if dp > 1 else " (one replica: no FSDP)"))


__all__ = ["describe_tensor_parallel", "tensor_parallel_problems"]
