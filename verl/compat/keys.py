"""What a volcengine/verl user types, and what it is here.

Its names for the same choices (`reinforce_plus_plus`, `low_var_kl`, ...) are accepted as ours
(`VERL_NAMES`). Its Hydra keys (`actor_rollout_ref.actor.optim.lr=1e-6`) are not: the error names our
key for each (`VERL_KEYS`) instead of only "unknown key". Keys are not translated silently, since the
meanings differ in places (counts, units, on/off switches), which the notes say.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

VERL_NAMES: dict[str, dict[str, str]] = {
    "adv_estimator": {"reinforce_plus_plus": "reinforce_pp", "reinforce_plus_plus_baseline": "reinforce_pp_baseline"},
    "kl_type": {"kl": "k1", "mse": "k2", "low_var_kl": "k3"},  # low_var_kl is k3, clamped to [-10, 10] there too
}


def verl_name(kind: str) -> Any:
    """A pydantic before-validator that turns verl's name of a `kind` choice into ours."""

    def convert(value: Any) -> Any:
        return VERL_NAMES[kind].get(value, value) if isinstance(value, str) else value

    return convert


_ARR = "actor_rollout_ref"
_NO_GRAD_PASSES = "actor.micro_batch_size (the no-grad passes run micro-batches of the update's size)"
_REWARD_FUNCTION = "reward.functions (a list of {name: FILE.py:FUNCTION})"

VERL_KEYS: dict[str, str] = {
    f"{_ARR}.model.path": "model.path",
    f"{_ARR}.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    f"{_ARR}.model.trust_remote_code": "model.trust_remote_code",
    f"{_ARR}.model.lora_rank": "model.lora.rank",
    f"{_ARR}.model.lora_alpha": "model.lora.alpha",
    f"{_ARR}.model.target_modules": "model.lora.target_modules",
    f"{_ARR}.model.use_remove_padding": "actor.remove_padding",
    f"{_ARR}.actor.optim.lr": "actor.lr",
    f"{_ARR}.actor.optim.weight_decay": "actor.weight_decay",
    f"{_ARR}.actor.optim.lr_warmup_steps": "actor.warmup_steps",
    f"{_ARR}.actor.optim.warmup_style": "actor.lr_schedule",
    f"{_ARR}.actor.optim.min_lr_ratio": "actor.min_lr_ratio",
    f"{_ARR}.actor.ppo_mini_batch_size": "actor.mini_batch_size",  # prompts per optimizer step in both
    f"{_ARR}.actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    f"{_ARR}.actor.use_dynamic_bsz": "actor.max_tokens_per_micro_batch (setting a token budget turns it on)",
    f"{_ARR}.actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_micro_batch",
    f"{_ARR}.actor.ulysses_sequence_parallel_size": "actor.sequence_parallel_size (the actor's forwards, and a "
                                                    "reference, critic and teacher on its ranks)",
    f"{_ARR}.actor.megatron.tensor_model_parallel_size": "actor.tensor_parallel_size (DTensor tensor parallelism "
                                                         "with FSDP2 over the rest of the actor's ranks)",
    f"{_ARR}.ref.megatron.tensor_model_parallel_size": "actor.tensor_parallel_size (the reference follows the "
                                                       "actor's mesh)",
    f"{_ARR}.rollout.tensor_model_parallel_size": "actor.tensor_parallel_size (vLLM's engines are split as the "
                                                  "actor is)",
    f"{_ARR}.actor.grad_clip": "actor.grad_clip",
    f"{_ARR}.actor.freeze_vision_tower": "actor.freeze_vision_tower",
    f"{_ARR}.actor.clip_ratio": "actor.clip_low and actor.clip_high",
    f"{_ARR}.actor.clip_ratio_low": "actor.clip_low",
    f"{_ARR}.actor.clip_ratio_high": "actor.clip_high",
    f"{_ARR}.actor.clip_ratio_c": "actor.dual_clip",
    f"{_ARR}.actor.policy_loss.loss_mode": "actor.policy_loss (vanilla is ppo, geo_mean is gmpo)",
    f"{_ARR}.actor.tis_imp_ratio_cap": "actor.rollout_correction.mode and actor.rollout_correction.cap (mode "
                                               "token_tis with that cap; verl's -1, off, is mode auto here)",
    f"{_ARR}.actor.loss_agg_mode": "actor.loss_agg",
    f"{_ARR}.actor.entropy_coeff": "actor.entropy_coef",
    f"{_ARR}.actor.use_kl_loss": "actor.kl_loss_coef (a value > 0 turns the KL loss on)",
    f"{_ARR}.actor.kl_loss_coef": "actor.kl_loss_coef",
    f"{_ARR}.actor.kl_loss_type": "actor.kl_loss_type",
    f"{_ARR}.actor.ppo_epochs": "actor.ppo_epochs",
    f"{_ARR}.actor.shuffle": "actor.shuffle",
    f"{_ARR}.ref.log_prob_micro_batch_size_per_gpu": _NO_GRAD_PASSES,
    f"{_ARR}.rollout.log_prob_micro_batch_size_per_gpu": _NO_GRAD_PASSES,
    f"{_ARR}.rollout.name": "rollout.engine (hf or vllm)",
    f"{_ARR}.rollout.n": "rollout.n",
    f"{_ARR}.rollout.temperature": "rollout.temperature",
    f"{_ARR}.rollout.top_p": "rollout.top_p",
    f"{_ARR}.rollout.top_k": "rollout.top_k (0 = off, where verl's vLLM uses -1)",
    f"{_ARR}.rollout.response_length": "rollout.max_new_tokens",
    f"{_ARR}.rollout.val_kwargs.temperature": "rollout.val_temperature",
    f"{_ARR}.rollout.val_kwargs.n": "rollout.val_n",
    f"{_ARR}.rollout.val_kwargs.do_sample": "rollout.val_temperature (> 0 samples; 0 is greedy)",
    "critic.optim.lr": "critic.lr",
    "critic.optim.weight_decay": "critic.weight_decay",
    "critic.optim.lr_warmup_steps": "critic.warmup_steps",
    "critic.model.path": "critic.path",
    "critic.model.use_remove_padding": "critic.remove_padding",
    "critic.ppo_mini_batch_size": "critic.mini_batch_size",
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size",
    "critic.ppo_max_token_len_per_gpu": "critic.max_tokens_per_micro_batch",
    "critic.ulysses_sequence_parallel_size": "actor.sequence_parallel_size (a critic on the actor's ranks splits "
                                             "with the actor's groups; one on ranks of its own runs whole sequences)",
    "critic.cliprange_value": "critic.value_clip",
    "reward_model.enable": "reward.model_path (naming a reward model turns it on)",
    "reward_model.reward_manager": "reward.executor (naive: thread, prime: process)",
    "reward_model.model.path": "reward.model_path",
    "reward_model.overlong_buffer.enable": "algorithm.overlong_buffer (a length > 0 turns it on)",
    "reward_model.overlong_buffer.len": "algorithm.overlong_buffer",
    "reward_model.overlong_buffer.penalty_factor": "algorithm.overlong_penalty",
    "custom_reward_function.path": _REWARD_FUNCTION,
    "custom_reward_function.name": _REWARD_FUNCTION,
    "algorithm.use_kl_in_reward": "algorithm.kl_in_reward",
    "algorithm.kl_penalty": "algorithm.kl_type",
    "algorithm.kl_ctrl.type": "algorithm.kl_ctrl",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "algorithm.kl_ctrl.target_kl": "algorithm.kl_target",
    "algorithm.kl_ctrl.horizon": "algorithm.kl_horizon",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_by_std",
    "algorithm.rollout_correction.bypass_mode": "actor.old_logprobs (true is sampler, false recompute)",
    "algorithm.filter_groups.enable": "algorithm.filter_groups",
    "algorithm.filter_groups.max_num_gen_batches": "algorithm.max_resample_rounds (extra rounds: verl's count - 1)",
    "data.prompt_key": "data.fields (e.g. data.fields.prompt=question)",
    "data.image_key": "data.fields (e.g. data.fields.images=image)",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.total_epochs": "trainer.total_steps (an RL run counts steps)",
    "trainer.save_freq": "checkpoint.save_interval",
    "trainer.test_freq": "trainer.val_every",
    "trainer.default_local_dir": "trainer.run_dir",
    "trainer.resume_mode": "trainer.resume (auto, never or a checkpoint path)",
    "trainer.max_actor_ckpt_to_keep": "checkpoint.save_total_limit",
    "trainer.critic_warmup": "critic.warmup_steps_critic_only",
    "trainer.log_val_generations": "trainer.log_samples",
    "trainer.logger": "logging.backends",
    "trainer.project_name": "logging.project",
    "trainer.experiment_name": "logging.experiment",
    "trainer.n_gpus_per_node": "devices.num_gpus_per_node",
    "trainer.nnodes": "verl train --nnodes N",
}


# volcengine/verl's SFT trainer (`verl.trainer.fsdp_sft_trainer`, config sft_trainer.yaml) -> ours in an SFT run
# (trainer.kind=sft; data.train_batch_size is ours too, for RL prompts). data.prompt_key/response_key and
# their *_dict_keys are data.fields paths (verl.compat.command.translate_sft), which joins the two-key settings.
VERL_SFT_KEYS: dict[str, str] = {
    "model.partial_pretrain": "model.path",
    "model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "model.lora_rank": "model.lora.rank",
    "model.lora_alpha": "model.lora.alpha",
    "model.target_modules": "model.lora.target_modules",
    "data.micro_batch_size_per_gpu": "actor.micro_batch_size",
    "data.train_batch_size": "sft.batch_size",
    "data.max_length": "data.max_prompt_length and data.max_response_length (each part's own limit here)",
    "ulysses_sequence_parallel_size": "actor.sequence_parallel_size",
    "use_remove_padding": "sft.packing (examples share rows without padding; with sequence parallelism a "
                          "micro-batch runs without padding whatever it says)",
    "optim.lr": "sft.lr",
    "optim.weight_decay": "actor.weight_decay",
    "optim.clip_grad": "actor.grad_clip",
    "optim.warmup_steps_ratio": "actor.warmup_steps (a count of steps, not a ratio)",
    "optim.lr_scheduler": "actor.lr_schedule (constant or cosine)",
    "trainer.total_epochs": "sft.epochs",
    "trainer.total_training_steps": "sft.steps",
    "trainer.default_local_dir": "trainer.run_dir",
    "trainer.save_freq": "checkpoint.save_interval",
    "trainer.test_freq": "trainer.val_every",
    "trainer.logger": "logging.backends",
    "trainer.project_name": "logging.project",
    "trainer.experiment_name": "logging.experiment",
    "trainer.n_gpus_per_node": "devices.num_gpus_per_node",
    "trainer.nnodes": "verl train --nnodes N",
}

def _dotted_keys(value: Any, prefix: str) -> Iterator[str]:
    if isinstance(value, Mapping) and value:
        for key, inner in value.items():
            yield from _dotted_keys(inner, f"{prefix}.{key}")
    else:
        yield prefix


def verl_key_hint(tree: Mapping[str, Any], loc: Sequence[str | int]) -> str:
    """For an unknown key at `loc` of the user's `tree`: the volcengine/verl keys under it and ours for each
    (empty when none is one of verl's)."""
    value: Any = tree
    for part in loc:
        value = value.get(part) if isinstance(value, Mapping) else None
    dotted = ".".join(map(str, loc))
    known = {**VERL_SFT_KEYS, **VERL_KEYS}
    found = [(key, known[key]) for key in _dotted_keys(value, dotted) if key in known]
    if found:
        pairs = "; ".join(f"{theirs} -> {ours}" for theirs, ours in found)
        return f" {'That is' if len(found) == 1 else 'Those are'} volcengine/verl's; here: {pairs}."
    if loc and loc[0] == _ARR:
        return (f" {_ARR} is volcengine/verl's section; here model, actor, rollout and ref are sections of their "
                "own (see README, Configuration).")
    return ""


__all__ = ["VERL_KEYS", "VERL_NAMES", "VERL_SFT_KEYS", "verl_key_hint", "verl_name"]
