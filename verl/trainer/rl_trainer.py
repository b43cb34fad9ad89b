"""`RLTrainer`: PPO / GRPO / RLOO / REINFORCE++ on a Hugging Face causal LM.

`step()` reads top to bottom as the algorithm: get prompts, sample responses, score them, compute the
reference/old log-probs and values, the advantages, then update the critic and the policy. Each stage is
a method, so a subclass can replace exactly one of them. The formulas all come from `verl.algorithms`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from verl.algorithms import explained_variance, masked_mean, place_score_on_last_token
from verl.batch import PROMPT, RESPONSE, RolloutBatch, concat_batches, fields_of, padding, read_by, written_by
from verl.config.schema import OptimConfig, RunConfig
from verl.env.base import Environment
from verl.env.multiturn import MultiTurnEnvironment
from verl.errors import ConfigError, RolloutError
from verl.models.vision_inputs import images_kwarg
from verl.rewards import TrainingProgress
from verl.rewards.manager import report_progress
from verl.rollout import SamplingParams
from verl.rollout.agent_episodes import episodes_for
from verl.rollout.weight_sync import ready_to_sample
from verl.trainer.build.precision import compute_dtype
from verl.trainer.checks.preflight import Given
from verl.trainer.compose.components import async_rollout_for
from verl.trainer.compose.runtime import TrainerRuntime
from verl.trainer.forward.batch_math import BatchPlan
from verl.trainer.forward.logprobs import can_share_prompt, logprobs_of, use_chunked_logprobs, values_of
from verl.trainer.forward.sequence_parallel import ActorSequenceParallel
from verl.trainer.rl import evaluation, update
from verl.trainer.rl.advantages import apply_kl_in_reward, apply_overlong_penalty, estimate_advantages, kl_controller
from verl.trainer.rl.correction import (
    CorrectionPlan,
    DriftGuard,
    OldLogprobPlan,
    combined_moments,
    drift_moments,
    judge_drift,
    plan_correction,
    plan_old_logprobs,
)
from verl.trainer.rl.distill import apply_distillation
from verl.trainer.rl.dynamic_sampling import filter_groups
from verl.trainer.rl.evaluation import Answers, evaluate_rows
from verl.trainer.rl.python_api import RewardArg, python_run
from verl.trainer.rl.rewards import RemoteRewardModel, RewardOverlap, accuracy_of, reward_parts, score_responses
from verl.trainer.rl.rl_state import RLCheckpointState
from verl.trainer.rl.step_metrics import batch_metrics, timed
from verl.trainer.rl.trace import RolloutTrace
from verl.utils.tokenizer_protocol import Tokenizer


class Part:
    """An `RLTrainer` attribute that is one of its composed parts (`trainer.parts.<name>`), read and written
    there: the stages use the composed parts themselves, under the names they read best, never copies."""

    def __init__(self, name: str, field: str | None = None) -> None:
        self.name, self.field = name, field  # `field`: an attribute of the part (an optimizer's scheduler)

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        part = getattr(trainer.parts, self.name)
        return part if self.field is None or part is None else getattr(part, self.field)

    def __set__(self, trainer: Any, value: Any) -> None:
        if self.field is not None:
            raise AttributeError(f"{self.name}.{self.field} is set by composing the trainer")
        setattr(trainer.parts, self.name, value)


class RLTrainer(RLCheckpointState, TrainerRuntime):
    """Online RL trainer. `RLTrainer(config).fit()`; see `from_pretrained` for use without YAML."""

    env = Part("env")  # prompts + rewards
    ref_model = Part("reference")
    critic = Part("critic")
    teacher = Part("teacher")
    engine = Part("engine")
    placement = Part("placement")
    val_rewards = Part("val_rewards")  # `reward.val_functions`, or None: validation scores as training does
    optimizer = Part("actor_optim", "optimizer")
    scheduler = Part("actor_optim", "scheduler")
    critic_optimizer = Part("critic_optim", "optimizer")
    critic_scheduler = Part("critic_optim", "scheduler")
    kind = "rl"
    runs_split_placements = True

    def __init__(
        self,
        config: RunConfig,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        env: Environment | MultiTurnEnvironment | None = None,
        rows: Sequence[Mapping[str, Any]] | None = None,
        reward_functions: Sequence[Any] | None = None,
    ) -> None:
        """`rows` (in-memory prompt rows) and `reward_functions` (specs or Python callables) replace
        `data.train_files` and `reward.functions` when given; `env` replaces the whole environment.
        Every part is built by `components.compose` (read it for the start-up order)."""
        super().__init__(config, given=Given(model=model, tokenizer=tokenizer, rows=rows, env=env,
                                             reward_functions=reward_functions))
        parts = self.parts
        self.plans: dict[str, BatchPlan] = self.checks.startup.plans
        # The actor's sequence-parallel group (actor.sequence_parallel_size > 1): its ranks pool their rows for
        # the actor's forwards and split every sequence (`verl.trainer.forward.sequence_parallel`).
        self.sp = ActorSequenceParallel(
            self.groups.sequence_parallel() if self.groups is not None and "actor" in self.roles else None,
            getattr(self.groups, "guard", None), self.tokenizer.pad_token_id, parts.placement.device)
        self.remote_reward_model = (RemoteRewardModel(parts.reward_tokenizer, parts.reward_scorer,
                                                      config.reward.model_weight)
                                    if parts.remote_reward_model else None)  # a reward model on ranks of its own
        self._can_share: dict[int, tuple[Any, bool]] = {}  # `shares_prompt`: what each model can do
        self._hf_assets = TrainerRuntime.hf_assets(self)  # before a critic/ref-only rank drops the policy
        self.sampling = self._sampling_params(config.rollout.temperature, config.rollout.n)
        if not {"actor", "rollout"} & self.roles:  # a critic/ref-only rank of a split placement drops the policy
            self.model = parts.policy = None
        # Multi-turn environments run episodes (model turns + observations) in `generate` and validation.
        self.multiturn = episodes_for(config, self.env, self.engine, self.prompts, policy=self.model,
                                      gathered=self.gathered, device=self.device)  # multi-turn or agent episodes
        if self.multiturn is not None and config.actor.tensor_parallel_size > 1:
            raise ConfigError(f"actor.tensor_parallel_size={config.actor.tensor_parallel_size} with a multi-turn "
                              f"environment ({type(self.env).__name__}): not combined with tensor parallelism yet: "
                              "every rank of a tensor-parallel group must run the same forwards, and episodes' "
                              "turns are not proven to. Fix: a single-turn environment, or set "
                              "actor.tensor_parallel_size=1")
        self.kl_ctrl, self.drift_guard = kl_controller(config.algorithm), DriftGuard()  # the guard's calibration
        self.entropy_ctrl = update.entropy_controller(config.actor)  # None: the fixed actor.entropy_coef
        self.async_rollout = async_rollout_for(config, parts, self.get_batch, self.generate, self.decode_responses)
        self.reward_overlap = RewardOverlap(config.reward.overlap and self.multiturn is None and not config.is_async,
                                            self.env, self.engine, self.decode_responses)  # scoring while generating
        if self.model is not None:  # actor.chunked_logprobs=true on a head it cannot take: refused now
            use_chunked_logprobs(config, self.model)
        self.trace = RolloutTrace(config, self.tokenizer) if RolloutTrace.wanted(config) else None  # verl view

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_pretrained(
        cls,
        model: str | torch.nn.Module | Mapping[str, Any] = "tiny",
        *,
        tokenizer: Tokenizer | None = None,
        reward_fn: RewardArg = None,
        dataset: str | Sequence[str] | Sequence[Mapping[str, Any]] | Any | None = None,
        env: Environment | MultiTurnEnvironment | None = None,
        peft_config: Any = None,
        reward_funcs: RewardArg = None,
        teacher_model: str | None = None,
        **overrides: Any,
    ) -> RLTrainer:
        """Python entry point without YAML, in TRL's terms (`python_api.python_run` builds the config).
        `model`: a path or hub id, a loaded model (with `tokenizer=`), or the model section as a dict
        (`{"path": "tiny", "lora": {"rank": 8}}`); `peft_config`: a peft `LoraConfig` (TRL's argument).
        `reward_fn` (or TRL's `reward_funcs`): a spec name (`"numeric_match"`, `"path.py:fn"`), a callable
        `fn(prompt, response, ground_truth, **meta)`, or a list mixing them. `dataset`: file path(s) (a
        save_to_disk folder too), prompt rows, or a `datasets.Dataset` / `DatasetDict` (its train split), checked
        like a file. `teacher_model`: a path or hub id to distil from (TRL's GKD argument; `algorithm.distill`).
        `overrides`: sections as dicts (`actor={"lr": 1e-6}`) or dotted keys."""
        if reward_fn is not None and reward_funcs is not None:
            raise ConfigError("from_pretrained got both reward_fn and reward_funcs (TRL's name for it); pass one")
        run = python_run(model, reward_fn=reward_fn if reward_funcs is None else reward_funcs, dataset=dataset,
                         peft_config=peft_config, teacher_model=teacher_model, overrides=overrides)
        return cls(run.config, model=run.model, tokenizer=tokenizer, env=env, rows=run.rows,
                   reward_functions=run.reward_functions)

    def _sampling_params(self, temperature: float, n: int) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(temperature=temperature, top_p=r.top_p, top_k=r.top_k or None,
                              max_new_tokens=r.max_new_tokens, n=n, eos_token_ids=self.eos_token_ids,
                              pad_token_id=self.tokenizer.pad_token_id)

    # ------------------------------------------------------------------ the RL step
    # What a split placement sends to a role's ranks (and back), from the batch's layout table.
    SEQUENCES = read_by("ref")  # the sequences (and a multi-turn episode's attention) a ref/critic forward reads
    CRITIC_UPDATE_INPUTS = read_by("critic_update")  # the sequences, values and returns

    def step(self) -> dict[str, float]:
        """One RL iteration; returns its metrics.

        Each stage runs on its role's ranks: `self.placement` runs it in place when the roles are
        colocated, and moves the fields it reads there and the fields it writes back when they are split.
        Every rank executes this same sequence of calls (the placement keeps the collectives in step).
        """
        run, timing, metrics = self.placement.run, {}, {}
        with timed(timing, "generate"):  # every rank draws, so the prompt order (saved in checkpoints) stays in step
            if self.async_rollout is not None:  # rollout ranks of their own sample ahead (trainer.async_rollout)
                batch, metrics = self.async_rollout.next_batch(self.step_count, self.model)
            else:
                batch = self.placement.align(run("actor", self.generate, self.get_batch()), self.sequence_padding)
        scores_first = self.config.algorithm.filter_groups  # resampling decides the batch the passes below run on
        if scores_first:
            batch = self.score_batch(batch, timing, metrics)
        with timed(timing, "old_logprobs"):
            batch = run("actor", self.compute_log_probs, batch)
        if self.config.needs_ref:
            with timed(timing, "ref"):
                batch = run("ref", self.compute_ref_log_probs, batch, send=self.SEQUENCES, back=written_by("ref"))
        if self.config.needs_teacher:
            with timed(timing, "teacher"):
                batch = run("teacher", self.compute_teacher_log_probs, batch, send=self.SEQUENCES,
                            back=written_by("teacher"))
        if self.config.needs_critic:
            with timed(timing, "critic"):
                batch = run("critic", self.compute_values, batch, send=self.SEQUENCES, back=written_by("critic"))
        if not scores_first:  # the reward calls (started as rows finished, or now) end behind the passes above
            batch = self.score_batch(batch, timing, metrics)
        with timed(timing, "advantages"):
            batch = run("actor", self.compute_advantages, batch)
        if self.config.needs_critic:
            with timed(timing, "update_critic"):
                metrics |= self.placement.run_for_metrics("critic", self.update_critic, batch,
                                                          send=self.CRITIC_UPDATE_INPUTS)
        if self.updates_actor:
            with timed(timing, "update"):
                metrics |= self.placement.run_for_metrics("actor", self.update_policy, batch)
        if self.async_rollout is not None:  # the new weights to the rollout ranks
            with timed(timing, "weight_delivery"):
                metrics |= self.async_rollout.deliver(self.model, self.step_count + 1)
        own = "async/rollout_" if self.async_rollout is not None and self.async_rollout.generates else "timing/"
        metrics |= {f"{own}{k}": v for k, v in timing.items()} | {f"{own}step": sum(timing.values())}
        if batch is not None:  # the actor ranks
            metrics |= batch_metrics(batch, self.placement, getattr(self.env, "metric_sources", None))
            metrics["perf/tokens_per_s"] = (float(batch.attention_mask.sum()) * self.dp_size
                                            / max(metrics["timing/step"], 1e-9))
        return self.placement.mean_over_owners(metrics)  # ranks may differ in which metrics they have

    def score_batch(self, batch: RolloutBatch | None, timing: dict, metrics: dict) -> RolloutBatch | None:
        """The rewards: the environment's, then DAPO's resampling and a reward model on ranks of its own."""
        with timed(timing, "reward"):
            batch = self.placement.run("actor", self.compute_reward, batch)
        if self.config.algorithm.filter_groups:
            with timed(timing, "resample"):
                batch = self.filter_groups(batch, metrics)
        if self.remote_reward_model is not None:
            with timed(timing, "reward_model"):
                batch = self.remote_reward_model.score(batch, self.placement)
        return batch

    def filter_groups(self, batch: RolloutBatch | None, metrics: dict[str, float]) -> RolloutBatch | None:
        """DAPO dynamic sampling (`dynamic_sampling.filter_groups`): each extra round draws, generates and
        scores with this trainer's stages."""
        run = self.placement.run

        def draw(round_: int) -> RolloutBatch | None:  # the rollout ranks' next batch, or one generated here
            more = (self.async_rollout.exchange(self.step_count)[0] if self.async_rollout is not None else
                    self.placement.align(run("actor", self.generate, self.get_batch()), self.sequence_padding))
            if more is not None:
                more.group_ids = more.group_ids + round_ * self.config.data.train_batch_size  # unique over rounds
            return run("actor", self.compute_reward, more)

        return filter_groups(batch, draw, placement=self.placement,
                             max_rounds=self.config.algorithm.max_resample_rounds,
                             pad_token_id=self.tokenizer.pad_token_id, metrics=metrics)

    @property
    def sequence_padding(self) -> dict[str, tuple[str, int | float]]:
        """How the prompt- and response-aligned fields pad when the actor ranks' shards are brought to one width."""
        return padding(fields_of(PROMPT, RESPONSE), self.tokenizer.pad_token_id)

    def get_batch(self) -> RolloutBatch:
        """This rank's share of the next prompts, tokenised and left-padded, each repeated n times."""
        rows = self.env.get_batch(self.config.data.train_batch_size)
        per_rank = len(rows) // self.dp_size
        rows = rows[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return RolloutBatch.of_prompts(rows, *self.prompt_batch(rows), n=self.config.rollout.n,
                                       first_group=self.dp_rank * per_rank)

    def generate(self, batch: RolloutBatch) -> RolloutBatch:
        if self.multiturn is not None:
            return self.multiturn.generate(batch, self.config.rollout.n, self.sampling, self.generator)
        n = self.config.rollout.n
        with ready_to_sample(self.engine, self.model, self.gathered), self.reward_overlap.generating(batch):
            out = self.engine.generate(batch.prompt_ids[::n].to(self.device), batch.prompt_mask[::n].to(self.device),
                                       self.sampling, generator=self.generator, **images_kwarg(batch.images[::n]))
        batch.prompt_ids, batch.prompt_mask = out.prompt_ids, out.prompt_mask.long()
        batch.response_ids, batch.response_mask = out.response_ids, out.response_mask.long()
        batch.finished = out.finished
        batch.rollout_logprobs = out.logprobs
        batch.responses = self.reward_overlap.responses(out.response_ids, out.response_mask)  # decoded once
        return batch

    def compute_reward(self, batch: RolloutBatch) -> RolloutBatch:
        """Sequence scores from the environment, placed on each response's last (model-written) token."""
        if batch.env_scores is not None:  # multi-turn: the environment scored each episode as it ended
            batch.scores = batch.env_scores.to(self.device, torch.float32)
        else:
            report_progress(self.env, TrainingProgress(self.step_count, self.config.trainer.total_steps,
                                                       getattr(self.env, "epoch", 0)))
            result = self.reward_overlap.finish(batch) or score_responses(  # started in `generate`, or here
                self.env, batch.rows, batch.responses, batch.response_ids, batch.response_mask)
            batch.scores = result.scores.to(self.device, torch.float32)
            batch.reward_parts = reward_parts(result) if self.trace is not None else []
            batch.metrics = {**batch.metrics, **result.metrics}  # after the drift check's
            batch.accuracy = accuracy_of(result, batch.scores)
            apply_overlong_penalty(batch, self.config.algorithm, self.config.rollout.max_new_tokens)
        batch.token_rewards = place_score_on_last_token(batch.scores, batch.response_mask.float())
        return batch

    def compute_log_probs(self, batch: RolloutBatch) -> RolloutBatch:
        """Log-probs of the sampled tokens under the actor before the update (when the update needs them:
        the sampler's, or a forward's, by `actor.old_logprobs`), and the on-policy check of the sampler."""
        if not self.needs_old_logprobs:
            return self.check_rollout_drift(batch)
        if self.old_logprobs_from_sampler(batch):
            batch.old_logprobs = batch.rollout_logprobs.clone()
            return self.check_rollout_drift(batch, trainer_has_them=False)
        if self.config.actor.old_logprobs == "sampler":
            raise RolloutError(f"actor.old_logprobs=sampler, but the {self.config.rollout.engine!r} rollout gave no "
                               "log-probs of its tokens (a custom engine or episode runner that leaves "
                               "RolloutBatch.rollout_logprobs unset). Fix: actor.old_logprobs=recompute, or "
                               "return the sampled tokens' log-probs from the rollout")
        batch.old_logprobs = self.sequence_logprobs(self.model, batch)
        return self.check_rollout_drift(batch)

    def check_rollout_drift(self, batch: RolloutBatch, *, trainer_has_them: bool = True) -> RolloutBatch:
        """The sampler's log-probs against the trainer's on the same tokens (`drift`): free when the old
        log-probs are the trainer's (`trainer_has_them`) or the update's forward checks
        (`update_checks_drift`), else on `rollout.drift_check_samples` responses."""
        if batch.rollout_logprobs is None:
            return batch
        own = batch.old_logprobs is not None and trainer_has_them
        if not own and self.update_checks_drift:
            return batch  # the update's first forwards are this step's on-policy pass: they check (update_policy)
        checked = batch if own else batch.select(torch.arange(min(self.config.rollout.drift_check_samples,
                                                                  len(batch))))
        trainer = checked.old_logprobs if own else self.sequence_logprobs(self.model, checked)
        self.judge_drift(batch, *drift_moments(trainer, checked))
        return batch

    def old_logprobs_from_sampler(self, batch: RolloutBatch) -> bool:
        """Whether this step's old log-probs are the sampler's (`actor.old_logprobs`, where the rollout gave them)."""
        return self.needs_old_logprobs and self.old_logprobs_plan.from_sampler and batch.rollout_logprobs is not None

    @property
    def update_checks_drift(self) -> bool:
        """Whether the policy update's own forwards do the drift check, saving a forward pass: those before its
        first optimizer step run on the weights that sampled, so they check where no pass computed the
        trainer's old log-probs (a single on-policy step, or the sampler's old log-probs); dropout off (the
        train-mode forward is then the sampler's eval-mode one), the update runs this step, and it is this
        class's (a subclass's own update_policy, or an optimize that may not call before_step, would not check)."""
        no_pass = not self.needs_old_logprobs or self.old_logprobs_plan.from_sampler
        return (no_pass and self.config.actor.disable_dropout and self.updates_actor
                and type(self).update_policy is RLTrainer.update_policy and type(self).optimize is RLTrainer.optimize)

    @property
    def updates_actor(self) -> bool:
        """Whether this step updates the policy (not during the critic-only warm-up)."""
        return self.step_count >= self.config.critic.warmup_steps_critic_only or not self.config.needs_critic

    def judge_drift(self, batch: RolloutBatch, moments: torch.Tensor, worst: torch.Tensor) -> None:
        stale = batch.rollout_version is not None and float(batch.rollout_version.min()) < self.step_count
        judge_drift(batch.metrics, moments, worst, rollout=self.config.rollout, placement=self.placement,
                    step=self.step_count + 1, guard=self.drift_guard, log_only=stale)

    def compute_ref_log_probs(self, batch: RolloutBatch) -> RolloutBatch:
        batch.ref_logprobs = self.sequence_logprobs(self.ref_model, batch)
        return batch

    def compute_teacher_log_probs(self, batch: RolloutBatch) -> RolloutBatch:
        """The distillation teacher's log-probs of the student's tokens (at the sampling temperature)."""
        batch.teacher_logprobs = self.sequence_logprobs(self.teacher, batch)
        return batch

    def sequence_logprobs(self, model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
        """Log-probs of the sampled response tokens under `model` (no gradient, eval mode); the policy's over
        its sequence-parallel group's pooled rows, when it has one."""
        temperature = self.config.rollout.temperature or 1.0
        return self.sp.own_rows_of(self.sp.splits(model, self.model), batch, "old_logprobs", lambda rows: (
            self.forward_in_micro_batches(model, rows,
                                          lambda mb: self.policy_logprobs(model, mb, temperature=temperature)[0],
                                          self.config.actor.max_tokens_per_micro_batch)))

    def shares_prompt(self, model: torch.nn.Module) -> bool:
        """Whether `model`'s forwards run each group's prompt once (`critic.share_prompt_forward` for the
        critic, `actor.share_prompt_forward` for the policy and the reference). Whether the model can is asked once
        (a walk of its modules): its wrappers, checkpointing and tensor parallelism are set when it is built."""
        cfg = self.config.critic if model is not None and model is self.critic else self.config.actor
        if not (cfg.share_prompt_forward and not cfg.remove_padding and self.config.rollout.n > 1):
            return False
        if id(model) not in self._can_share:  # the entry holds the model, so its id stays its own
            self._can_share[id(model)] = model, can_share_prompt(model) and not self.sp.splits(model, self.model)
        return self._can_share[id(model)][1]

    def policy_logprobs(self, model: torch.nn.Module, mb: RolloutBatch, *, temperature: float,
                        with_entropy: bool = False, entropy_grad: bool = True
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of `mb`'s response tokens under `model`, sharing prompts when it can."""
        return logprobs_of(model, mb, share=self.shares_prompt(model), temperature=temperature,
                           with_entropy=with_entropy, entropy_grad=entropy_grad,
                           chunked=use_chunked_logprobs(self.config, model), packed=self.config.actor.remove_padding,
                           sp=self.sp.sp if self.sp.splits(model, self.model) else None)

    def compute_values(self, batch: RolloutBatch) -> RolloutBatch:
        batch.values = self.sp.own_rows_of(self.sp.splits(self.critic, self.model), batch, "values", lambda rows: (
            self.forward_in_micro_batches(self.critic, rows, self.critic_values,
                                          self.config.critic.max_tokens_per_micro_batch)))
        return batch

    def critic_values(self, mb: RolloutBatch) -> torch.Tensor:
        return values_of(self.critic, mb, share=self.shares_prompt(self.critic),
                         packed=self.config.critic.remove_padding,
                         sp=self.sp.sp if self.sp.splits(self.critic, self.model) else None)

    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        """KL in the reward (when configured), the estimator, then the distillation term (`algorithm.distill`);
        statistics over the global batch."""
        algo, reduce = self.config.algorithm, functools.partial(self.placement.all_reduce_sum, role="actor")
        batch = estimate_advantages(apply_kl_in_reward(batch, algo, self.kl_ctrl, reduce), algo, reduce)
        return apply_distillation(batch, algo.distill, reduce) if self.config.needs_teacher else batch

    def update_policy(self, batch: RolloutBatch) -> dict[str, float]:
        """PPO-clip epochs over shuffled mini-batches with gradient accumulation over micro-batches."""
        cfg, temperature, step_batch = self.config.actor, self.config.rollout.temperature or 1.0, batch
        if self.trace is not None:  # logging.rollout_samples: a few of the step's rows, as the loss sees them
            batch = self.trace.before_update(batch)
        if cfg.mask_truncated:
            batch = update.without_truncated(batch)
        batch, plan, replicas = self.sp.update_rows(self.sp.size > 1, batch, self.plans["actor"], cfg)
        norm_len = update.norm_length(batch, self.config.rollout.max_new_tokens)
        # The drift check on this update's forwards before its first optimizer step (see update_checks_drift)
        drift = [] if batch.rollout_logprobs is not None and self.update_checks_drift else None
        judged: list[bool] = []
        trace = self.trace if self.sp.size == 1 else None  # a sequence-parallel rank holds part of a row's tokens

        def on_policy_forward(logprobs: torch.Tensor, mb: RolloutBatch) -> None:
            if not judged:  # only the forwards before the first optimizer step ran on the sampling weights
                drift.append(drift_moments(logprobs, mb))

        entropy_coef = cfg.entropy_coef if self.entropy_ctrl is None else self.entropy_ctrl.value
        micro_loss = update.policy_loss(
            cfg, norm_len, lambda mb: self.policy_logprobs(self.model, mb, temperature=temperature, with_entropy=True,
                                                           entropy_grad=entropy_coef > 0),
            on_logprobs=None if drift is None else on_policy_forward,
            on_traced=trace.observe if trace is not None else None,
            entropy_coef=entropy_coef, correction=self.correction,
            distill=self.config.algorithm.distill if self.config.needs_teacher else None)

        def before_step() -> None:  # before each optimizer step
            if drift is not None and not judged:  # the first: a failed check leaves the weights alone
                judged.append(True)
                self.judge_drift(step_batch, *combined_moments(drift))  # its metrics are the step's
            if trace is not None:
                trace.stepped()

        metrics = self.optimize(self.model, self.optimizer, self.scheduler, batch, cfg, plan,
                                micro_loss, prefix="actor", replicas=replicas,
                                contributes=self.contributing_sequences if self.skips_zero_advantage else None,
                                keep_groups=self.shares_prompt(self.model),
                                before_step=None if drift is None and trace is None else before_step,
                                metric_kinds=update.ACTOR_METRICS)
        if self.entropy_ctrl is not None:
            metrics |= update.steer_entropy(self.entropy_ctrl, metrics, self.placement)
        if batch.ref_logprobs is not None:
            metrics["actor/ref_kl"] = float(masked_mean(batch.old_logprobs - batch.ref_logprobs,
                                                        batch.response_mask.float()))
        if self.trace is not None:
            self.trace.after_update(step_batch, self.step_count + 1)
        return metrics

    def update_critic(self, batch: RolloutBatch) -> dict[str, float]:
        cfg = self.config.critic
        batch, plan, replicas = self.sp.update_rows(self.sp.splits(self.critic, self.model), batch,
                                                    self.plans["critic"], cfg)
        norm_len = update.norm_length(batch, self.config.rollout.max_new_tokens)
        metrics = self.optimize(self.critic, self.critic_optimizer, self.critic_scheduler, batch, cfg, plan,
                                update.critic_loss(cfg, norm_len, self.critic_values), prefix="critic",
                                replicas=replicas, keep_groups=self.shares_prompt(self.critic),
                                metric_kinds=update.CRITIC_METRICS)
        mask = batch.response_mask.float()
        metrics["critic/explained_var"] = float(explained_variance(batch.values, batch.returns, mask))
        metrics["critic/values_mean"] = float(masked_mean(batch.values, mask))
        return metrics

    @functools.cached_property
    def old_logprobs_plan(self) -> OldLogprobPlan:
        """`actor.old_logprobs` for this run's engine and compute dtype (`plan_old_logprobs`)."""
        return plan_old_logprobs(self.config, compute_dtype(self.config, self.device.type, self.dtype))

    @functools.cached_property
    def correction(self) -> CorrectionPlan:
        """`actor.rollout_correction` for this run's engine and compute dtype (`plan_correction`)."""
        return plan_correction(self.config, compute_dtype(self.config, self.device.type, self.dtype))

    @property
    def skips_zero_advantage(self) -> bool:
        distill = self.config.algorithm.distill  # its loss term trains sequences of zero advantage too
        return (update.skips_zero_advantage(self.config.actor)
                and not (self.config.needs_teacher and distill.mode == "loss"))

    contributing_sequences = staticmethod(update.contributing_sequences)

    # ------------------------------------------------------------------ shared machinery
    @property
    def needs_old_logprobs(self) -> bool:
        """Old log-probs need a separate pass unless the update is a single on-policy step (distillation's
        reverse KL reads them before the update)."""
        plan, config = self.plans["actor"], self.config
        return (config.algorithm.kl_in_reward or config.actor.ppo_epochs > 1 or plan.num_mini_batches > 1
                or config.needs_ref or config.needs_teacher)

    def optimize(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 batch: RolloutBatch, cfg: OptimConfig, plan: BatchPlan, micro_loss: update.MicroLoss, *,
                 prefix: str, **options: Any) -> dict[str, float]:
        """The optimize loop of `update.optimize` on this trainer's placement, shuffle stream and optimizer
        step (a hook: a subclass may wrap it; `options` are update.optimize's keyword arguments)."""
        return update.optimize(module, optimizer, scheduler, batch, cfg, plan, micro_loss, prefix=prefix,
                               placement=self.placement, clip_and_step=self.clip_and_step,
                               generator=self.shuffle_generator, **options)

    def forward_in_micro_batches(self, model: torch.nn.Module, batch: RolloutBatch,
                                 fn: Callable[[RolloutBatch], torch.Tensor],
                                 max_tokens: int | None = None) -> torch.Tensor:
        """`fn` over micro-batches of the update's size of `model`'s role (the critic's plan for the critic,
        the actor's for the policy and the reference; per sequence-parallel group over its pooled rows where
        the critic, or the actor, splits), without gradient: see update.forward_in_micro_batches."""
        critic = model is not None and model is self.critic
        role, cfg = ("critic", self.config.critic) if critic else ("actor", self.config.actor)
        grouped = not critic or self.sp.splits(model, self.model)
        plan = self.sp.plan(self.plans[role], cfg) if grouped else self.plans[role]
        owner = self.sharding_role(model)
        return update.forward_in_micro_batches(model, batch, fn, plan.micro_batch_size, max_tokens, plan.packed,
                                               rounds=lambda count: update.micro_batch_rounds(count, self.placement,
                                                                                              owner))

    def sharding_role(self, model: torch.nn.Module) -> str:
        """The role whose ranks shard `model` and so run its forwards together: the critic's, the reference's
        or the teacher's when they have ranks of their own, else the actor's."""
        groups = self.placement.groups
        for role, held in (("critic", self.critic), ("ref", self.ref_model), ("teacher", self.teacher)):
            if held is not None and model is held and groups is not None and role in groups.mapping.roles:
                return role
        return "actor"

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Greedy (or `rollout.val_temperature`) answers on the held-out rows; mean score."""
        # The actor ranks answer (each its share of the rows); every rank gets the result.
        samples: list[dict[str, Any]] = []
        metrics = self.placement.mean_over_owners(
            self.evaluate(self.env.val_rows(), prefix="val", samples=samples) if self.placement.holds("actor") else {})
        # The first `trainer.log_samples` generations, for samples.jsonl and the console (see loop.fit).
        self.validation_samples = samples[: self.config.trainer.log_samples]
        return metrics

    def evaluate(self, rows: Sequence[Mapping[str, Any]], prefix: str = "val",
                 samples: list[dict[str, Any]] | None = None, **report: Any) -> dict[str, float]:
        """Score and metric@k of `rollout.val_n` answers per row (`rollout.val_k`), sampled as validation samples
        them (`evaluation.evaluate_rows`, which `verl eval` runs too: every actor rank calls this with the same
        rows), scored by `reward.val_functions` when set, else as training scores. With `samples`, up to
        `trainer.log_samples` of {prompt, response, score, ground_truth} go into it; `report` (progress,
        report) goes to evaluate_rows."""
        if not rows:
            return {}
        r = self.config.rollout
        params = self._sampling_params(r.val_temperature, r.val_n)
        # Its own stream, derived from (seed, step, rank): sampled validation is reproducible, survives a
        # resume, and never shifts the training samples (which `self.generator` alone decides).
        # (The ranks of a tensor-parallel group sample together: the stream of their replica.)
        sampler = self.dp_rank if self.config.actor.tensor_parallel_size > 1 else self.rank
        generator = evaluation.validation_generator(self.config.trainer.seed, self.step_count, sampler, self.device)

        def answer(chunk: list[Mapping[str, Any]]) -> Answers:
            if self.multiturn is not None:
                scores, responses, episode = self.multiturn.evaluate(chunk, params, generator)
                return Answers(scores, responses, episode_metrics=episode)
            ids, mask, images = self.prompt_batch(chunk)
            with ready_to_sample(self.engine, self.model, self.gathered):
                out = self.engine.generate(ids.to(self.device), mask.to(self.device), params, generator,
                                           **images_kwarg(images))
            responses = self.decode_responses(out.response_ids, out.response_mask)
            repeated = [row for row in chunk for _ in range(r.val_n)]
            result = score_responses(self.env, repeated, responses, out.response_ids, out.response_mask)
            return evaluation.validation_answers(result, responses, repeated, self.val_rewards)

        return evaluate_rows(rows, answer, n=r.val_n, ks=r.val_k, chunk_size=self.config.data.val_batch_size,
                             dp_rank=self.dp_rank, dp_size=self.dp_size, prefix=prefix, samples=samples,
                             all_reduce_sum=functools.partial(self.placement.all_reduce_sum, role="actor"),
                             max_samples=self.config.trainer.log_samples,
                             extract_answers=evaluation.answer_extractor(self.env),
                             **report)

    def row_counts(self) -> tuple[int, int]:
        return len(self.env), len(self.env.val_rows())


__all__ = ["RLTrainer", "concat_batches"]
