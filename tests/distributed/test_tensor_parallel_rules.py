"""Tensor parallelism without processes: what `verl check` (and the trainer's start-up, the same table) refuses
with `actor.tensor_parallel_size > 1`, what it says the setting does, the batch plan over the data-parallel
replicas, and verl's Megatron keys."""

from __future__ import annotations

import pytest

from verl.compat.command import translate
from verl.config import load_config
from verl.trainer.checks.preflight import preflight


def _check(*overrides, world=2):
    config = load_config(overrides=["env.name=arithmetic", "trainer.device=cpu", *overrides])
    return preflight(config, world_size=world, device_type="cpu", check_model=False)


def test_a_supported_run_is_described_and_planned_over_the_data_parallel_replicas():
    ok = _check("actor.tensor_parallel_size=2", "data.train_batch_size=2", world=4)
    assert ok.messages == []
    [note] = [n for n in ok.startup.rl_notes if n.startswith("tensor parallelism")]
    assert "2 data-parallel replica(s) x 2 tensor-parallel ranks" in note and "FSDP2 shards over the 2" in note
    assert ok.startup.plans["actor"].dp_size == 2  # 2 prompts split over 2 replicas, not 4 ranks
    one = _check("actor.tensor_parallel_size=2", "data.train_batch_size=1", world=2)
    assert one.messages == [] and one.startup.plans["actor"].dp_size == 1
    assert any("(one replica: no FSDP)" in n for n in one.startup.rl_notes)


def test_vllm_is_combined_with_tensor_parallelism():
    """vLLM's engines of a tensor-parallel group are one split engine (tests/rollout/test_vllm_sync.py)."""
    report = _check("actor.tensor_parallel_size=2", "rollout.engine=vllm", world=2)
    assert not [m for m in report.messages if "actor.tensor_parallel_size=2 with" in m], report.messages


def test_the_size_must_divide_the_actor_ranks_and_the_model():
    [ranks] = _check("actor.tensor_parallel_size=2", world=1).messages
    assert ranks == ("[start-up] actor.tensor_parallel_size=2 does not divide the actor's 1 rank(s): each "
                     "tensor-parallel group is 2 consecutive actor ranks. Fix: launch a multiple of 2 processes "
                     "(verl train --nproc 2), or use a divisor of 1")
    # the tiny model: 4 heads, 2 key/value heads, intermediate 256
    [model] = _check("actor.tensor_parallel_size=3", "data.train_batch_size=3", world=3).messages
    assert model.startswith("[start-up] actor.tensor_parallel_size=3: cannot split the model over tensor-parallel "
                            "ranks: config.num_attention_heads=4 is not divisible by the tensor-parallel size 3")
    assert "Fix: use a tensor-parallel size that divides all of them ([1, 2])" in model


def test_other_trainers_are_refused():
    config = load_config(overrides=["trainer.kind=sft", "data.kind=sft", "data.train_files=[x.jsonl]",
                                    "trainer.device=cpu", "actor.tensor_parallel_size=2"])
    report = preflight(config, world_size=2, device_type="cpu", check_model=False)
    assert any("actor.tensor_parallel_size=2 with trainer.kind=sft: tensor parallelism is implemented for the RL "
               "trainer (its actor and reference) only" in m for m in report.messages)


@pytest.mark.parametrize("overrides,what,fix", [
    (["model.lora.rank=4"], "LoRA (model.lora)", "set model.lora.rank=0 (full fine-tuning)"),
    (["actor.sequence_parallel_size=2", "data.train_batch_size=4"], "actor.sequence_parallel_size=2",
     "set actor.sequence_parallel_size=1"),
    (["actor.remove_padding=true"], "packed sequences (actor.remove_padding=true)", "set actor.remove_padding=false"),
    (["actor.chunked_logprobs=true"], "actor.chunked_logprobs=true", "set actor.chunked_logprobs=auto"),
    (["fsdp.cpu_offload=true"], "CPU offload (fsdp.cpu_offload / actor.cpu_offload)",
     "set fsdp.cpu_offload=false and actor.cpu_offload=false"),
    (["actor.cpu_offload=true"], "CPU offload (fsdp.cpu_offload / actor.cpu_offload)",
     "set fsdp.cpu_offload=false and actor.cpu_offload=false"),
    (["fsdp.sharding_strategy=HYBRID_SHARD", "fsdp.hybrid_shard_size=2", "data.train_batch_size=4"],
     "fsdp.sharding_strategy=HYBRID_SHARD", "set fsdp.sharding_strategy=FULL_SHARD (or SHARD_GRAD_OP)"),
    (["fsdp.sharding_strategy=NO_SHARD"], "fsdp.sharding_strategy=NO_SHARD",
     "set fsdp.sharding_strategy=FULL_SHARD (or SHARD_GRAD_OP)"),
    (["algorithm.adv_estimator=gae"], "a critic (algorithm.adv_estimator=gae)", "use a critic-free estimator"),
    (["actor.kl_loss_coef=0.1", "devices.actor=[0,1]", "devices.ref=[2,3]", "data.train_batch_size=2"],
     "roles on device groups of their own (devices.*)", "remove devices.ref/critic/teacher/reward/rollout"),
])
def test_combinations_not_supported_yet_are_refused_with_what_why_and_fix(overrides, what, fix):
    world = 4 if any(o.startswith(("devices.", "fsdp.hybrid", "actor.sequence")) for o in overrides) else 2
    messages = _check("actor.tensor_parallel_size=2", *overrides, world=world).messages
    [refusal] = [m for m in messages if m.startswith(f"[start-up] actor.tensor_parallel_size=2 with {what}:")]
    assert "not combined with tensor parallelism yet: " in refusal  # ... the reason
    assert f"Fix: {fix}" in refusal and refusal.endswith("or set actor.tensor_parallel_size=1")


def test_verl_megatron_tensor_parallel_sizes_translate():
    out = translate(["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                     "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"])
    assert "actor.tensor_parallel_size=2" in out.ours
    assert not [d for d in out.decide if "tensor_model_parallel_size" in d[0]]  # the reference follows the actor
    out = translate(["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                     "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4"])
    assert ("actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4",
            "actor.tensor_parallel_size (the reference follows the actor's mesh here; it has no size of its own)"
            ) in out.decide
    # verl's FSDP actor with a 2-way vLLM: here vLLM is split only with the actor, so that is to decide
    out = translate(["actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    [(key, why)] = [d for d in out.decide if "tensor_model_parallel_size" in d[0]]
    assert key == "actor_rollout_ref.rollout.tensor_model_parallel_size=2" and "split as the actor is" in why
    out = translate(["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                     "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    assert "actor.tensor_parallel_size=2" in out.ours and not [d for d in out.decide if "tensor_model" in d[0]]
