"""`RLTrainer`: PPO / GRPO / RLOO / REINFORCE++ on a Hugging Face causal LM.

`step()` reads top to bottom as the algorithm: get prompts, sample responses, score them, compute the
reference/old log-probs and values, the advantages, then update the critic and the policy. Each stage is
a method, so a subclass can replace exactly one of them. The formulas all come from `verl.algorithms`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from verl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_returns,
    compute_rloo_advantages,
    explained_variance,
    kl_penalty,
    masked_mean,
    masked_whiten,
    place_score_on_last_token,
    ppo_policy_loss,
    value_loss,
)
from verl.config.loader import build_config, set_dotted
from verl.config.schema import OptimConfig, RunConfig
from verl.errors import ConfigError, DataError
from verl.rollout import SamplingParams, build_engine
from verl.trainer.batch import RolloutBatch
from verl.trainer.batch_math import BatchPlan
from verl.trainer.forward import response_logprobs, response_values
from verl.trainer.models import build_reference
from verl.trainer.optim import build_optimizer
from verl.trainer.runtime import TrainerRuntime


class RLTrainer(TrainerRuntime):
    """Online RL trainer. `RLTrainer(config).fit()`; see `from_pretrained` for use without YAML."""

    kind = "rl"
    runs_split_placements = True

    def __init__(
        self,
        config: RunConfig,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        env: Any = None,
        rows: Sequence[Mapping[str, Any]] | None = None,
        reward_functions: Sequence[Any] | None = None,
    ) -> None:
        """`rows` (in-memory prompt rows) and `reward_functions` (specs or Python callables) replace
        `data.train_files` and `reward.functions` when given; `env` replaces the whole environment."""
        super().__init__(config, model=model, tokenizer=tokenizer, rows=rows, env=env, reward_functions=reward_functions)
        self.plans: dict[str, BatchPlan] = self.startup.plans
        if rows is not None and config.env.name is not None:
            raise ConfigError(f"prompt rows were passed in, but env.name={config.env.name!r} makes its own "
                              "prompts; drop the rows or set env.name to null (the rows + reward functions)")
        self.model, self.tokenizer = self.load_policy(model, tokenizer)
        if env is None:
            env = self.build_env(None if rows is None else self.canonical_rows(rows), reward_functions)
        self.env = env
        # Each rank builds what its roles need: all of it when colocated; with a split placement every rank
        # loaded the policy once so the ref and critic start from the actor's initial weights.
        self.ref_model = self.build_reference() if config.needs_ref and "ref" in self.roles else None
        self.critic = self.build_critic() if config.needs_critic and "critic" in self.roles else None
        self._hf_assets = super().hf_assets()
        self.sampling = self._sampling_params(config.rollout.temperature, config.rollout.n)
        if "actor" not in self.roles:  # a critic/ref-only rank of a split placement drops the policy
            self.model = self.optimizer = self.scheduler = self.engine = None
        else:
            self.model = self.shard(self.model, "actor")  # after the ref/critic copies: they start from full weights
            total_updates = (config.trainer.total_steps * config.actor.ppo_epochs
                             * self.plans["actor"].num_mini_batches)
            self.optimizer, self.scheduler = build_optimizer(self.model.parameters(), config.actor,
                                                             total_steps=total_updates)
            self.engine = build_engine(config.rollout.engine, self.model)
        if self.critic is not None:
            self.critic = self.shard(self.critic, "critic")
            critic_updates = (config.trainer.total_steps * config.critic.ppo_epochs
                              * self.plans["critic"].num_mini_batches)
            self.critic_optimizer, self.critic_scheduler = build_optimizer(
                self.critic.parameters(), config.critic, total_steps=critic_updates)
        if self.remote_reward_model:  # scores on its own ranks; the actor ranks only tokenise for it
            from verl.models.reward_model import RewardModelScorer
            from verl.utils.hf_loader import load_tokenizer

            r = config.reward
            self.reward_tokenizer = load_tokenizer(r.model_path, trust_remote_code=config.model.trust_remote_code)
            if "reward" in self.roles:
                self.reward_scorer = RewardModelScorer(
                    r.model_path, self.reward_tokenizer, dtype=self._resolve_dtype(r.model_dtype or config.model.dtype),
                    device=self.device, trust_remote_code=config.model.trust_remote_code)
        algo = config.algorithm
        self.kl_ctrl = (AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)
                        if algo.kl_ctrl == "adaptive" else FixedKLController(algo.kl_coef))

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_pretrained(
        cls,
        model: str | torch.nn.Module = "tiny",
        *,
        tokenizer: Any = None,
        reward_fn: str | Callable[..., Any] | Sequence[Any] | None = None,
        dataset: str | Sequence[str] | Sequence[Mapping[str, Any]] | None = None,
        env: Any = None,
        **overrides: Any,
    ) -> RLTrainer:
        """Python entry point without YAML.

        `overrides` are sections as dicts (`actor={"lr": 1e-6}`) or dotted keys (`**{"actor.lr": 1e-6}`);
        the `model` section's other keys go in dotted form, since `model` names the model itself
        (`**{"model.dtype": "bfloat16"}`).
        `dataset` is a file path (or list of paths) or a list of prompt rows; `reward_fn` is a reward spec
        name (`"numeric_match"`, `"path.py:fn"`), a callable `fn(prompt, response, ground_truth, **meta)`,
        or a list of specs.
        """
        tree: dict[str, Any] = {}
        for key, value in overrides.items():  # a section dict is its dotted keys: both forms merge
            for sub, item in (value.items() if isinstance(value, Mapping) else [(None, value)]):
                set_dotted(tree, f"{key}.{sub}" if sub is not None else key, item)
        if isinstance(model, str):
            tree.setdefault("model", {})["path"] = model
        rows = None
        if isinstance(dataset, str) or (isinstance(dataset, Sequence) and dataset and isinstance(dataset[0], str)):
            tree.setdefault("data", {})["train_files"] = [dataset] if isinstance(dataset, str) else list(dataset)
        elif dataset is not None:
            rows = list(dataset)
        functions = None
        if callable(reward_fn):
            functions = [reward_fn]
        elif isinstance(reward_fn, str):
            tree.setdefault("reward", {})["functions"] = [{"name": reward_fn}]
        elif reward_fn is not None:
            tree.setdefault("reward", {})["functions"] = list(reward_fn)
        config = build_config(tree, source="RLTrainer.from_pretrained arguments")
        return cls(config, model=None if isinstance(model, str) else model, tokenizer=tokenizer, env=env,
                   rows=rows, reward_functions=functions)

    def canonical_rows(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """In-memory rows through the same field aliases as files (`question`/`answer`, `data.fields`)."""
        from verl.data.fields import RowError, RowNormalizer

        normalizer = RowNormalizer("prompt", self.config.data.fields or None)
        out = []
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise DataError(f"dataset[{i}] is a {type(row).__name__}; each row must be a dict like "
                                "{'prompt': '...', 'ground_truth': '...'} (or pass file paths as strings)")
            try:
                out.append(normalizer.normalize(dict(row))[0])
            except RowError as exc:
                raise DataError(f"dataset[{i}]: {exc.detail}; fix the row or map its keys with "
                                "data.fields (e.g. data={'fields': {'prompt': 'my_column'}})") from None
        if not out:
            raise DataError("dataset=[] has no rows; pass at least one prompt row")
        return out

    def build_reference(self) -> torch.nn.Module:
        """The frozen KL anchor: `ref.path` when set, else a copy of the actor's initial weights."""
        return build_reference(self.config, self.model, self.tokenizer, device=self.device, dtype=self.dtype)

    def build_critic(self) -> torch.nn.Module:
        from verl.models.critic import ValueModel

        if self.config.critic.path:
            critic = ValueModel.from_pretrained(self.config.critic.path, dtype=self.dtype,
                                                trust_remote_code=self.config.model.trust_remote_code)
        else:
            critic = ValueModel.from_actor(self.model)
        return critic.to(self.device).train()

    def _sampling_params(self, temperature: float, n: int) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(temperature=temperature, top_p=r.top_p, top_k=r.top_k or None,
                              max_new_tokens=r.max_new_tokens, n=n, eos_token_ids=self.eos_token_ids,
                              pad_token_id=self.tokenizer.pad_token_id)

    # ------------------------------------------------------------------ the RL step
    def step(self) -> dict[str, float]:
        """One RL iteration; returns its metrics."""
        if self.split:
            return self.split_step()
        timing: dict[str, float] = {}
        with self.timer(timing, "generate"):
            batch = self.get_batch()
            batch = self.generate(batch)
        with self.timer(timing, "reward"):
            batch = self.compute_reward(batch)
        with self.timer(timing, "ref"):
            batch = self.compute_log_probs(batch)
        if self.critic is not None:
            with self.timer(timing, "critic"):
                batch = self.compute_values(batch)
        with self.timer(timing, "advantages"):
            batch = self.compute_advantages(batch)
        metrics: dict[str, float] = {}
        if self.critic is not None:
            with self.timer(timing, "update_critic"):
                metrics |= self.update_critic(batch)
        with self.timer(timing, "update"):
            if self.step_count >= self.config.critic.warmup_steps_critic_only or self.critic is None:
                metrics |= self.update_policy(batch)
        metrics |= self.batch_metrics(batch)
        metrics = self.mean_over_owners(metrics)  # ranks may differ in which metrics they have
        metrics |= {f"timing/{k}": v for k, v in timing.items()}
        total = sum(timing.values())
        metrics["timing/step"] = total
        metrics["perf/tokens_per_s"] = float(batch.attention_mask.sum()) * self.dp_size / max(total, 1e-9)
        return metrics

    # Tensors a ref or critic rank needs to run the model on the actor's sequences.
    SEQUENCE_FIELDS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")

    def split_step(self) -> dict[str, float]:
        """One RL iteration with roles on different ranks (devices.actor/critic/ref): the stages of `step()`,
        each run by its role's ranks, with the batch moved between role groups.

        Every rank calls every `move_batch` in this order; a rank outside the receiving role gets None and
        skips that stage. Only GAE needs the critic; the other estimators stay on the actor ranks.
        """
        timing: dict[str, float] = {}
        actor, groups = "actor" in self.roles, self.groups
        with self.timer(timing, "generate"):
            batch = self.get_batch()  # on every rank: the prompt order (saved in checkpoints) stays in step
            if actor:
                batch = self.pad_to_actor_width(self.generate(batch))
        if actor:
            with self.timer(timing, "reward"):
                batch = self.compute_reward(batch)
        if self.remote_reward_model:
            with self.timer(timing, "reward_model"):
                got = groups.move_batch(self.reward_model_inputs(batch) if actor else None, "actor", "reward",
                                        stage="reward_inputs")
                back = None if got is None else {
                    "scores": self.reward_scorer.score_ids(got["input_ids"], got["attention_mask"])}
                back = groups.move_batch(back, "reward", "actor", stage="reward_scores")
            if actor:
                batch = self.add_reward_model_scores(batch, back["scores"])
        if actor and self.needs_old_logprobs:
            with self.timer(timing, "old_logprobs"):
                batch.old_logprobs = self.sequence_logprobs(self.model, batch)
        if self.config.needs_ref:
            with self.timer(timing, "ref"):
                got = groups.move_batch(self.fields(batch, self.SEQUENCE_FIELDS) if actor else None,
                                        "actor", "ref", stage="ref_inputs")
                back = None if got is None else {"ref_logprobs": self.sequence_logprobs(self.ref_model,
                                                                                         self.received(got))}
                back = groups.move_batch(back, "ref", "actor", stage="ref_logprobs")
            if actor:
                batch.ref_logprobs = back["ref_logprobs"]
        metrics: dict[str, float] = {}
        if actor:
            batch = self.apply_kl_in_reward(batch)
        if self.config.needs_critic:
            fields = self.SEQUENCE_FIELDS + ("token_rewards",)
            got = groups.move_batch(self.fields(batch, fields) if actor else None, "actor", "critic", stage="values")
            back = None
            if got is not None:
                with self.timer(timing, "critic"):
                    critic_batch = self.estimate_advantages(self.compute_values(self.received(got)))
                with self.timer(timing, "update_critic"):
                    metrics |= self.update_critic(critic_batch)
                back = self.fields(critic_batch, ("advantages", "returns"))
            back = groups.move_batch(back, "critic", "actor", stage="advantages")
            if actor:
                batch.advantages, batch.returns = back["advantages"], back["returns"]
        elif actor:
            with self.timer(timing, "advantages"):
                batch = self.estimate_advantages(batch)
        if actor:
            with self.timer(timing, "update"):
                if self.step_count >= self.config.critic.warmup_steps_critic_only or not self.config.needs_critic:
                    metrics |= self.update_policy(batch)
            metrics |= self.batch_metrics(batch)
        metrics |= {f"timing/{k}": v for k, v in timing.items()}
        metrics["timing/step"] = sum(timing.values())
        if actor:
            metrics["perf/tokens_per_s"] = (float(batch.attention_mask.sum()) * self.dp_size
                                            / max(metrics["timing/step"], 1e-9))
        return self.mean_over_owners(metrics)

    def reward_model_inputs(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        """The reward model's token ids for prompt + response, padded to one width over the actor ranks."""
        import torch.distributed as dist
        import torch.nn.functional as F

        from verl.trainer.reward_model import reward_text

        texts = [reward_text(self.reward_tokenizer, row["prompt"], response)
                 for row, response in zip(batch.rows, batch.responses, strict=True)]
        enc = self.reward_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        width = torch.tensor([enc["input_ids"].shape[1]], device=self.device)
        self.groups.all_reduce(width, "actor", "reward_width", op=dist.ReduceOp.MAX)
        extra = int(width) - enc["input_ids"].shape[1]
        pad = self.reward_tokenizer.pad_token_id
        return {"input_ids": F.pad(enc["input_ids"], (0, extra), value=pad),
                "attention_mask": F.pad(enc["attention_mask"], (0, extra), value=0)}

    def add_reward_model_scores(self, batch: RolloutBatch, scores: torch.Tensor) -> RolloutBatch:
        """Add `reward.model_weight` x the reward model's scores, as the reward function would colocated."""
        scores = scores.to(batch.scores.device, torch.float32)
        batch.scores = batch.scores + self.config.reward.model_weight * scores
        batch.token_rewards = place_score_on_last_token(batch.scores, batch.response_mask.float())
        batch.reward_metrics["reward/reward_model/score"] = float(scores.mean())
        return batch

    def pad_to_actor_width(self, batch: RolloutBatch) -> RolloutBatch:
        """Pad prompts (left) and responses (right) to the widest actor rank's, so that the shards of the
        actor ranks can be concatenated when they move to another role."""
        import torch.distributed as dist
        import torch.nn.functional as F

        widths = torch.tensor([batch.prompt_ids.shape[1], batch.response_ids.shape[1]], device=self.device)
        self.groups.all_reduce(widths, "actor", "widths", op=dist.ReduceOp.MAX)
        extra_p = int(widths[0]) - batch.prompt_ids.shape[1]
        extra_r = int(widths[1]) - batch.response_ids.shape[1]
        pad = self.tokenizer.pad_token_id
        batch.prompt_ids = F.pad(batch.prompt_ids, (extra_p, 0), value=pad)
        batch.prompt_mask = F.pad(batch.prompt_mask, (extra_p, 0), value=0)
        batch.response_ids = F.pad(batch.response_ids, (0, extra_r), value=pad)
        batch.response_mask = F.pad(batch.response_mask, (0, extra_r), value=0)
        return batch

    @staticmethod
    def fields(batch: RolloutBatch, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """The named tensors of a batch, as `move_batch` sends them."""
        return {name: getattr(batch, name) for name in names}

    @staticmethod
    def received(fields: Mapping[str, torch.Tensor]) -> RolloutBatch:
        """A batch on a ref/critic rank from the tensors it was sent (no prompt rows: it needs none)."""
        n = fields["prompt_ids"].shape[0]
        return RolloutBatch(rows=[{} for _ in range(n)], group_ids=torch.arange(n),
                            **{k: v for k, v in fields.items() if k != "group_ids"})

    def get_batch(self) -> RolloutBatch:
        """This rank's share of the next prompts, tokenised and left-padded, each repeated n times."""
        rows = self.env.get_batch(self.config.data.train_batch_size)
        per_rank = len(rows) // self.dp_size
        rows = rows[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        ids, mask = self.encode_prompts(rows)
        n = self.config.rollout.n
        return RolloutBatch(
            rows=[row for row in rows for _ in range(n)],
            group_ids=torch.arange(len(rows)).repeat_interleave(n) + self.dp_rank * per_rank,
            prompt_ids=ids.repeat_interleave(n, dim=0),
            prompt_mask=mask.repeat_interleave(n, dim=0),
        )

    def generate(self, batch: RolloutBatch) -> RolloutBatch:
        n = self.config.rollout.n
        with self.gathered(self.model):
            out = self.engine.generate(batch.prompt_ids[::n].to(self.device), batch.prompt_mask[::n].to(self.device),
                                       self.sampling, generator=self.generator)
        batch.prompt_ids, batch.prompt_mask = out.prompt_ids, out.prompt_mask.long()
        batch.response_ids, batch.response_mask = out.response_ids, out.response_mask.long()
        batch.finished = out.finished
        batch.responses = self.decode_responses(out.response_ids, out.response_mask)
        return batch

    def compute_reward(self, batch: RolloutBatch) -> RolloutBatch:
        """Sequence scores from the environment, placed on each response's last token."""
        result = self.env.compute_reward(batch.rows, batch.responses)
        batch.scores = result.scores.to(self.device, torch.float32)
        batch.reward_metrics = dict(result.metrics)
        batch.token_rewards = place_score_on_last_token(batch.scores, batch.response_mask.float())
        return batch

    def compute_log_probs(self, batch: RolloutBatch) -> RolloutBatch:
        """Log-probs of the sampled tokens under the current actor (pre-update) and the reference."""
        if self.needs_old_logprobs:
            batch.old_logprobs = self.sequence_logprobs(self.model, batch)
        if self.ref_model is not None:
            batch.ref_logprobs = self.sequence_logprobs(self.ref_model, batch)
        return batch

    def sequence_logprobs(self, model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
        """Log-probs of the sampled response tokens under `model` (no gradient)."""
        temperature = self.config.rollout.temperature or 1.0
        return self.forward_in_micro_batches(
            batch, lambda mb: response_logprobs(model, mb.input_ids, mb.attention_mask, mb.position_ids,
                                                mb.response_ids.shape[1], temperature=temperature)[0])

    def compute_values(self, batch: RolloutBatch) -> RolloutBatch:
        batch.values = self.forward_in_micro_batches(
            batch, lambda mb: response_values(self.critic, mb.input_ids, mb.attention_mask, mb.position_ids,
                                              mb.response_ids.shape[1]))
        return batch

    def compute_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        return self.estimate_advantages(self.apply_kl_in_reward(batch))

    def apply_kl_in_reward(self, batch: RolloutBatch) -> RolloutBatch:
        """With `algorithm.kl_in_reward`, subtract the (controlled) KL to the reference from the token rewards."""
        algo, mask = self.config.algorithm, batch.response_mask.float()
        rewards = batch.token_rewards
        if algo.kl_in_reward:
            kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, algo.kl_type) * mask
            rewards = rewards - self.kl_ctrl.value * kl
            current_kl = float(masked_mean(kl.sum(-1), (mask.sum(-1) > 0).float()))
            batch.reward_metrics["kl/in_reward"] = current_kl
            batch.reward_metrics["kl/coef"] = float(self.kl_ctrl.value)
            self.kl_ctrl.update(current_kl, len(batch))
        batch.token_rewards = rewards
        return batch

    def estimate_advantages(self, batch: RolloutBatch) -> RolloutBatch:
        """Advantages and returns from the token rewards (and the values, for GAE)."""
        algo, mask, rewards = self.config.algorithm, batch.response_mask.float(), batch.token_rewards
        if algo.adv_estimator == "gae":
            adv, ret = compute_gae(rewards, batch.values, mask, algo.gamma, algo.lam)
            batch.advantages = masked_whiten(adv, mask) * mask if algo.whiten_advantages else adv
            batch.returns = ret
        elif algo.adv_estimator == "reinforce_pp":
            ret = compute_reinforce_pp_returns(rewards, mask, algo.gamma)
            batch.advantages = masked_whiten(ret, mask) * mask if algo.whiten_advantages else ret
            batch.returns = ret
        else:
            scores = rewards.sum(-1)  # the score, minus the KL penalty when it is in the reward
            if algo.adv_estimator == "grpo":
                seq_adv = compute_grpo_advantages(scores, batch.group_ids.to(scores.device), algo.norm_by_std)
            else:
                seq_adv = compute_rloo_advantages(scores, batch.group_ids.to(scores.device))
            batch.advantages = seq_adv[:, None] * mask
            batch.returns = batch.advantages
        return batch

    def update_policy(self, batch: RolloutBatch) -> dict[str, float]:
        """PPO-clip epochs over shuffled mini-batches with gradient accumulation over micro-batches."""
        cfg, temperature = self.config.actor, self.config.rollout.temperature or 1.0
        norm_len = batch.response_ids.shape[1]

        def micro_loss(mb: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
            mask = mb.response_mask.float()
            logprobs, entropy = response_logprobs(self.model, mb.input_ids, mb.attention_mask, mb.position_ids,
                                                  norm_len, temperature=temperature, with_entropy=True,
                                                  entropy_grad=cfg.entropy_coef > 0)
            old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
            loss, stats = ppo_policy_loss(logprobs, old, mb.advantages, mask, clip_low=cfg.clip_low,
                                          clip_high=cfg.clip_high, dual_clip=cfg.dual_clip, agg=cfg.loss_agg,
                                          norm_len=norm_len)
            metrics = {"actor/pg_loss": float(loss.detach()), "actor/clipfrac": stats["clipfrac"],
                       "actor/approx_kl": stats["approx_kl"]}
            ent = aggregate_loss(entropy, mask, cfg.loss_agg, norm_len=norm_len)
            metrics["actor/entropy"] = float(ent.detach())
            if cfg.entropy_coef > 0:
                loss = loss - cfg.entropy_coef * ent
            if cfg.kl_loss_coef > 0:
                kl = aggregate_loss(kl_penalty(logprobs, mb.ref_logprobs, cfg.kl_loss_type), mask, cfg.loss_agg,
                                    norm_len=norm_len)
                loss = loss + cfg.kl_loss_coef * kl
                metrics["actor/kl_loss"] = float(kl.detach())
            return loss, metrics

        metrics = self.optimize(self.model, self.optimizer, self.scheduler, batch, cfg, self.plans["actor"],
                                micro_loss, prefix="actor")
        if batch.ref_logprobs is not None:
            metrics["actor/ref_kl"] = float(masked_mean(batch.old_logprobs - batch.ref_logprobs,
                                                        batch.response_mask.float()))
        return metrics

    def update_critic(self, batch: RolloutBatch) -> dict[str, float]:
        cfg = self.config.critic
        norm_len = batch.response_ids.shape[1]

        def micro_loss(mb: RolloutBatch) -> tuple[torch.Tensor, dict[str, float]]:
            mask = mb.response_mask.float()
            values = response_values(self.critic, mb.input_ids, mb.attention_mask, mb.position_ids, norm_len)
            loss, stats = value_loss(values, mb.values, mb.returns, mask, clip_range=cfg.value_clip, agg=cfg.loss_agg)
            return loss, {"critic/vf_loss": float(loss.detach()), **{f"critic/{k}": v for k, v in stats.items()}}

        metrics = self.optimize(self.critic, self.critic_optimizer, self.critic_scheduler, batch, cfg,
                                self.plans["critic"], micro_loss, prefix="critic")
        mask = batch.response_mask.float()
        metrics["critic/explained_var"] = float(explained_variance(batch.values, batch.returns, mask))
        metrics["critic/values_mean"] = float(masked_mean(batch.values, mask))
        return metrics

    # ------------------------------------------------------------------ shared machinery
    @property
    def needs_old_logprobs(self) -> bool:
        """Old log-probs need a separate pass unless the update is a single on-policy step."""
        plan = self.plans["actor"]
        return (self.config.algorithm.kl_in_reward or self.config.actor.ppo_epochs > 1
                or plan.num_mini_batches > 1 or self.config.needs_ref)

    def optimize(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        batch: RolloutBatch,
        cfg: OptimConfig,
        plan: BatchPlan,
        micro_loss: Callable[[RolloutBatch], tuple[torch.Tensor, dict[str, float]]],
        *,
        prefix: str,
    ) -> dict[str, float]:
        """Epochs x shuffled mini-batches x micro-batches; each micro loss is weighted by its share of the
        mini-batch (tokens for token-mean, sequences otherwise) so accumulation equals one big batch."""
        module.train()
        sums: dict[str, float] = {}
        counts = 0
        grad_norms = []
        n = len(batch)
        for _ in range(cfg.ppo_epochs):
            order = (torch.randperm(n, generator=self.shuffle_generator) if cfg.shuffle else torch.arange(n))
            for start in range(0, n, plan.mini_batch_sequences):
                mini = batch.select(order[start : start + plan.mini_batch_sequences])
                weights = self.micro_weights(mini, plan.micro_batch_size, cfg.loss_agg, role=prefix)
                optimizer.zero_grad(set_to_none=True)
                for (mb, weight) in zip(self._micro_batches(mini, plan.micro_batch_size), weights, strict=True):
                    loss, stats = micro_loss(mb)
                    (loss * weight).backward()
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + v
                    counts += 1
                grad_norms.append(self.clip_and_step(module, optimizer, cfg.grad_clip))
                scheduler.step()
        metrics = {k: v / max(counts, 1) for k, v in sums.items()}
        metrics[f"{prefix}/grad_norm"] = sum(grad_norms) / max(len(grad_norms), 1)
        metrics[f"{prefix}/lr"] = scheduler.get_last_lr()[0]
        return metrics

    @staticmethod
    def _micro_batches(batch: RolloutBatch, size: int) -> Iterator[RolloutBatch]:
        for start in range(0, len(batch), size):
            yield batch.select(torch.arange(start, min(start + size, len(batch))))

    def micro_weights(self, mini: RolloutBatch, size: int, agg: str, role: str = "actor") -> list[float]:
        """Each micro-batch's share of the global mini-batch (tokens for token-mean, else sequences).

        Shares are of the total over the role's data-parallel ranks, times the number of ranks because FSDP
        averages gradients: the accumulated gradient is that of one big batch, however it is split.
        """
        mask = mini.response_mask
        units = mask.sum(-1) if agg == "token-mean" else (mask.sum(-1) > 0).long()
        total = max(self.all_reduce_sum([float(units.sum())], role)[0], 1.0)
        ranks = self.role_size(role)
        return [float(units[s : s + size].sum()) * ranks / total for s in range(0, len(mini), size)]

    def forward_in_micro_batches(self, batch: RolloutBatch, fn: Callable[[RolloutBatch], torch.Tensor]) -> torch.Tensor:
        size = self.plans["actor"].micro_batch_size * 2  # no activations kept: twice the training micro size
        with torch.no_grad():
            return torch.cat([fn(mb) for mb in self._micro_batches(batch, size)], dim=0)

    def batch_metrics(self, batch: RolloutBatch) -> dict[str, float]:
        scores, mask = batch.scores, batch.response_mask.float()
        lengths = mask.sum(-1)
        metrics = {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                   "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
                   "response/truncation_ratio": float((~batch.finished).float().mean()),
                   "prompt/length_mean": float(batch.prompt_mask.float().sum(-1).mean())}
        if bool(((scores == 0) | (scores == 1)).all()):
            metrics["reward/accuracy"] = float(scores.mean())
        groups = batch.group_ids.to(scores.device)
        _, inverse = torch.unique(groups, return_inverse=True)
        g_max = torch.full((int(inverse.max()) + 1,), -float("inf"), device=scores.device).scatter_reduce(
            0, inverse, scores, "amax")
        g_min = torch.full_like(g_max, float("inf")).scatter_reduce(0, inverse, scores, "amin")
        metrics["reward/zero_std_group_frac"] = float((g_max == g_min).float().mean())
        metrics |= batch.reward_metrics
        metrics["advantages/mean"] = float(masked_mean(batch.advantages, mask))
        return metrics

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Greedy (or `rollout.val_temperature`) answers on the held-out rows; mean score."""
        if self.split:  # the actor ranks answer; every rank gets their mean
            return self.mean_over_owners(self.evaluate(self.env.val_rows(), prefix="val")
                                         if "actor" in self.roles else {})
        return self.evaluate(self.env.val_rows(), prefix="val")

    def evaluate(self, rows: Sequence[Mapping[str, Any]], prefix: str = "val") -> dict[str, float]:
        """Mean score (and accuracy, for 0/1 rewards) of one answer per row, as validation samples them."""
        if not rows:
            return {}
        params = self._sampling_params(self.config.rollout.val_temperature, 1)
        # Its own stream, derived from (seed, step, rank): sampled validation is reproducible, survives a
        # resume, and never shifts the training samples (which `self.generator` alone decides).
        entropy = np.random.SeedSequence([self.config.trainer.seed, self.step_count, self.rank, 1])
        generator = torch.Generator(device=self.device).manual_seed(int(entropy.generate_state(1)[0]))
        scores = []
        size = self.config.data.val_batch_size
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            ids, mask = self.encode_prompts(chunk)
            with self.gathered(self.model):
                out = self.engine.generate(ids.to(self.device), mask.to(self.device), params,
                                           generator=generator)
            responses = self.decode_responses(out.response_ids, out.response_mask)
            scores.append(self.env.compute_reward(chunk, responses).scores.float())
        all_scores = torch.cat(scores)
        metrics = {f"{prefix}/score": float(all_scores.mean())}
        if bool(((all_scores == 0) | (all_scores == 1)).all()):
            metrics[f"{prefix}/accuracy"] = float(all_scores.mean())
        return metrics

    # ------------------------------------------------------------------ state for checkpoints
    def trainer_state(self) -> dict[str, Any]:
        return {"kl_ctrl": self.kl_ctrl.state_dict(), "env": self.env.state_dict()}

    def load_trainer_state(self, state: Mapping[str, Any]) -> None:
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.env.load_state_dict(state["env"])

    def app_state(self) -> dict[str, Any]:
        """What this rank holds (split placements: actor ranks the policy, critic ranks the critic; the
        checkpoint is their union)."""
        state: dict[str, Any] = {}
        if self.model is not None:
            state |= {"model": self.model, "optimizer": self.optimizer}
        if self.critic is not None:
            state |= {"critic": self.critic, "critic_optimizer": self.critic_optimizer}
        return state

    def schedulers(self) -> dict[str, Any]:
        out = {}
        if self.model is not None:
            out["scheduler"] = self.scheduler
        if self.critic is not None:
            out["critic_scheduler"] = self.critic_scheduler
        return out

    def hf_assets(self) -> tuple[Any, ...]:
        return self._hf_assets  # captured at start-up: a critic-only rank (maybe rank 0) holds no policy

    @staticmethod
    @contextmanager
    def timer(timing: dict[str, float], name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start

    @staticmethod
    def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
        ref = copy.deepcopy(model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref


__all__ = ["RLTrainer"]
