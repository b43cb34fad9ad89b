"""Batch arithmetic: prompts per step, samples per prompt, mini- and micro-batches, data-parallel ranks.

Checked before anything loads, with the numbers shown, so a bad combination is never a silent zero
accumulation step or a NaN three hours in.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.algorithms.estimators import ESTIMATORS
from verl.config.schema import OptimConfig, RunConfig
from verl.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    prompts_per_step: int  # global
    sequences_per_step: int  # global = prompts * n
    dp_size: int
    sequences_per_rank: int
    mini_batch_sequences: int  # per rank, per optimizer step
    num_mini_batches: int
    micro_batch_size: int  # per rank
    grad_accum_steps: int  # micro-batches per mini-batch (the last may be smaller)
    packed: bool = False  # remove_padding: a token budget counts each micro-batch's real tokens

    def describe(self) -> str:
        return (f"{self.prompts_per_step} prompts x n -> {self.sequences_per_step} sequences/step over "
                f"{self.dp_size} rank(s) = {self.sequences_per_rank}/rank; {self.num_mini_batches} optimizer "
                f"step(s) of {self.mini_batch_sequences} sequences/rank, {self.grad_accum_steps} micro-batch(es) "
                f"of <= {self.micro_batch_size}")


def plan_batches(prompts: int, n: int, cfg: OptimConfig, dp_size: int, *, role: str = "actor") -> BatchPlan:
    """Validate and derive the mini/micro layout for one role; raises ConfigError listing every problem."""
    problems = []
    mini_prompts = cfg.mini_batch_size or prompts
    sequences = prompts * n
    numbers = (f"data.train_batch_size={prompts}, rollout.n={n}, {role}.mini_batch_size={cfg.mini_batch_size}, "
               f"{role}.micro_batch_size={cfg.micro_batch_size}, data-parallel ranks={dp_size}")
    if prompts % dp_size:
        problems.append(f"data.train_batch_size={prompts} prompts cannot be split evenly over {dp_size} ranks; "
                        f"use a multiple of {dp_size}")
    if mini_prompts > prompts:
        problems.append(f"{role}.mini_batch_size={mini_prompts} is larger than data.train_batch_size={prompts}; "
                        f"set it to at most {prompts}")
    elif prompts % mini_prompts:
        problems.append(f"data.train_batch_size={prompts} is not a multiple of {role}.mini_batch_size="
                        f"{mini_prompts}; the last optimizer step would be partial. Use a divisor of {prompts}")
    if (mini_prompts * n) % dp_size:
        problems.append(f"{role}.mini_batch_size x rollout.n = {mini_prompts * n} sequences cannot be split over "
                        f"{dp_size} ranks; make it a multiple of {dp_size}")
    if problems:
        raise ConfigError("batch arithmetic does not work out (" + numbers + "):\n"
                          + "\n".join(f"  - {p}" for p in problems))
    mini_per_rank = mini_prompts * n // dp_size
    micro = min(cfg.micro_batch_size, mini_per_rank)
    return BatchPlan(
        prompts_per_step=prompts,
        sequences_per_step=sequences,
        dp_size=dp_size,
        sequences_per_rank=sequences // dp_size,
        mini_batch_sequences=mini_per_rank,
        num_mini_batches=prompts // mini_prompts,
        micro_batch_size=micro,
        grad_accum_steps=-(-mini_per_rank // micro),
        packed=cfg.remove_padding,
    )


def plan_rl(config: RunConfig, dp_size: int = 1, critic_dp_size: int | None = None) -> dict[str, BatchPlan]:
    """Plans for the actor (and critic for PPO); both checked so every problem is reported together.

    `critic_dp_size` is the critic's rank count when it is placed apart from the actor (default: the same)."""
    plans, errors = {}, []
    roles = [("actor", config.actor, dp_size)]
    if config.needs_critic:
        roles.append(("critic", config.critic, critic_dp_size or dp_size))
    for role, cfg, size in roles:
        try:
            plans[role] = plan_batches(config.data.train_batch_size, config.rollout.n, cfg, size, role=role)
        except ConfigError as exc:
            errors.append(str(exc))
    if ESTIMATORS[config.algorithm.adv_estimator].needs_groups and config.rollout.n < 2:
        errors.append(f"algorithm.adv_estimator={config.algorithm.adv_estimator} compares the samples of a prompt "
                      f"with each other, but rollout.n={config.rollout.n}: every advantage would be 0. "
                      "Set rollout.n >= 2 (typically 4-16)")
    if errors:
        raise ConfigError("\n".join(errors))
    return plans
