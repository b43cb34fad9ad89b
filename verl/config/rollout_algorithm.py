"""The sections of sampling (rollout, vLLM) and of the RL algorithm (advantages, KL, distillation)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from verl.algorithms.estimators import ESTIMATOR_NAMES
from verl.compat.keys import verl_name
from verl.config.section import Section, _home, _split_csv


class VLLMConfig(Section):
    """`rollout.vllm`: vLLM's own engine settings (used with rollout.engine=vllm), passed to `vllm.LLM`."""

    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=1.0, description="Share of each GPU's memory vLLM takes for its weights, activations and "
        "KV cache while it samples on the actor's ranks (vLLM's own default, 0.92, assumes it is alone on the GPU; "
        "colocated, the sharded policy and optimizer states stay resident beside it). Under torchrun vLLM gives "
        "every rank the smallest KV cache of all ranks, so this also caps the KV cache of asynchronous rollout "
        "ranks (verl check says so).")
    rollout_rank_gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="The same share for the engines of asynchronous rollout ranks "
        "(devices.rollout), which have the GPU to themselves; None = 0.9. Their KV cache is still at most what "
        "the actor ranks' engines have (under torchrun vLLM gives every rank the smallest over all ranks): "
        "raising this does not enlarge it, setting it below gpu_memory_utilization shrinks every rank's.")
    per_request_seeds: bool = Field(False, description="Give every request its own seed (drawn from the trainer's "
                                    "sampling generator), so each response is reproducible on its own whatever vLLM "
                                    "batches with it; costs vLLM's fused top-k/top-p sampler. False = vLLM's own "
                                    "generator, seeded at start with trainer.seed (+ rank).")
    max_model_len: int | None = Field(
        None, gt=0, description="Longest prompt + response vLLM plans its KV cache for; None = the model's "
        "context length (config.json). data.max_prompt_length + rollout.max_new_tokens is enough for training.")
    enforce_eager: bool = Field(False, description="True = no CUDA graphs: slower decoding, but faster start-up "
                                "and less memory.")


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = "hf"
    max_staleness: int = Field(1, ge=0, description="Asynchronous rollout (devices.rollout): the rollout ranks "
                               "generate up to this many batches ahead, so a batch is trained at most this many "
                               "updates after the weights that sampled it; 0 = synchronous on the split ranks, "
                               "1 = one-step off-policy.")
    partial_rollout: bool = Field(True, description="Asynchronous rollout: a rollout rank takes the new weights "
                                  "between two tokens of the responses it is writing (the rest of them is sampled "
                                  "by the new weights, each token's version and log-prob recorded) instead of "
                                  "after its batch. False = a batch is sampled by one version. Our own sampler only: "
                                  "off with rollout.engine=vllm, which samples a batch in one call.")
    n: int = Field(4, gt=0, description="Responses sampled per prompt.")
    max_new_tokens: int = Field(256, gt=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = off.")
    val_temperature: float = Field(0.0, ge=0.0, description="0 = greedy validation.")
    val_n: int = Field(1, gt=0, description="Answers sampled per held-out prompt (needs val_temperature > 0): "
                       "val/score is their mean; see val_k for val/pass@k, val/maj@k and val/mean@k.")
    val_k: list[int] = Field(default_factory=list, description="The k of the metric@k validation logs (and `verl "
                             "eval` prints), each at most val_n: val/pass@k (the unbiased estimator of Chen et al. "
                             "2021; val/best@k, the expected best score of k answers, when scores are not 0/1), "
                             "val/maj@k (majority vote over the reward functions' extracted answers) and val/mean@k, "
                             "each also per data_source when the rows mix several. Empty = [val_n] when val_n > 1.")
    _split_k = field_validator("val_k", mode="before")(_split_csv)
    max_logprob_drift: float | None = Field(
        0.1, gt=0.0, description="Stop when the sampler's log-probs differ from the trainer's on the same tokens "
        "by more than this (mean |difference| per token over the batch): the engine samples from other weights "
        "than the policy's. None = only log rollout/logprob_diff_*.")
    drift_noise_ratio: float | None = Field(
        20.0, gt=1.0, description="Stop when the drift exceeds this many times the run's own numeric noise: the "
        "drift of its first step, when sampler and trainer hold the same initial weights whatever the engine "
        "does (floor 1e-6 per token). Catches an engine one update behind at lr 1e-6, which the fixed "
        "max_logprob_drift never sees. None = only the fixed limit.")
    drift_growth_steps: int = Field(
        6, ge=0, description="Stop when the drift rose on most of the last N steps, doubled over them and is "
        "above 4x the noise: an engine falling further behind with every update. 0 = off.")
    drift_check_samples: int = Field(
        4, gt=0, description="Responses per rank checked for drift when no pass computes the trainer's old "
        "log-probs and the update's forward cannot check (with dropout off, a single on-policy update, or one on "
        "the sampler's old log-probs, checks every row it trains on before its first optimizer step, at no "
        "cost).")
    stop: list[str] = Field(default_factory=list, description="Multi-turn environments: a model turn ends at "
                            "the first of these strings (e.g. '</calc>') or at eos; the environment answers it.")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="vLLM engine settings (rollout.engine=vllm).")

    @property
    def filters(self) -> bool:
        """Whether top-k / top-p filter the sampled distribution: the sampler's log-probs are then those of
        the renormalised distribution, not the policy's."""
        return self.top_k > 0 or self.top_p < 1.0


class DistillConfig(Section):
    """On-policy distillation (`verl.algorithms.distill`): the student samples, a teacher scores the
    student's tokens, and the per-token reverse KL to the teacher is trained on, alone or with the task
    reward."""

    teacher_path: str | None = Field(None, description="The teacher (a causal LM with the student's tokenizer; "
                                     "any size); None = no distillation. Placed by devices.teacher.")
    _home = field_validator("teacher_path", mode="before")(_home)
    mode: Literal["reward", "loss"] = Field(
        "reward", description="reward: -coef x the reverse KL per token is added to the advantages (clipped and "
        "corrected like them); loss: coef x 0.5 (log pi_s - log pi_t)^2 is added to the actor's loss (its "
        "gradient on the student's samples is the reverse KL's).")
    coef: float = Field(1.0, gt=0.0, description="Weight of the reverse KL.")
    discount: float = Field(0.0, ge=0.0, le=1.0, description="mode=reward: a token's advantage also carries the "
                            "KL of the tokens after it, discounted by this (0 = its own token only).")
    task_reward: bool = Field(True, description="Train on the environment's reward too (its advantages plus the "
                              "distillation term); false = distillation alone (the reward is still logged).")

    @model_validator(mode="after")
    def _discount_needs_reward_mode(self) -> DistillConfig:
        if self.discount > 0 and self.mode != "reward":
            raise ValueError(f"algorithm.distill.discount={self.discount} applies to mode=reward (the KL as a "
                             "per-token reward); mode=loss trains on each token's own KL. Fix: set "
                             "algorithm.distill.mode=reward or discount=0.")
        return self


class AlgorithmConfig(Section):
    adv_estimator: Literal[ESTIMATOR_NAMES] = "grpo"  # the names of verl.algorithms.estimators
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(1.0, ge=0.0, le=1.0)
    norm_by_std: bool = True
    std_scope: Literal["group", "batch"] = Field("group", description="grpo with norm_by_std: divide by the std of "
                                                 "the group's scores, or of every score in the batch.")
    kl_in_reward: bool = False
    kl_coef: float = Field(0.001, ge=0.0)
    kl_type: Literal["k1", "k2", "k3", "abs"] = "k1"
    _verl_estimator = field_validator("adv_estimator", mode="before")(verl_name("adv_estimator"))
    _verl_kl = field_validator("kl_type", mode="before")(verl_name("kl_type"))
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    kl_target: float = Field(0.1, gt=0.0, description="Adaptive controller's target KL per token: the mean over "
                             "a response's tokens, averaged over the global batch (verl's unit).")
    kl_horizon: int = Field(10000, gt=0)
    whiten_advantages: bool = Field(True, description="Whiten GAE / REINFORCE++ advantages over the batch.")
    filter_groups: bool = Field(False, description="DAPO dynamic sampling (group estimators): sample more prompts "
                                "and keep only groups whose accuracies differ (the reward's `acc` extra, else the "
                                "score before the overlong penalty) until the global batch is full; the groups "
                                "are dealt out over the actor ranks.")
    max_resample_rounds: int = Field(3, ge=0, description="filter_groups: extra sampling rounds at most; a batch "
                                     "still short after them is filled with equal-reward groups (skipped in the "
                                     "update, so they cost no gradient).")
    overlong_buffer: int = Field(0, ge=0, description="DAPO overlong reward shaping: a response reaching into the "
                                 "last N tokens before rollout.max_new_tokens loses up to overlong_penalty, "
                                 "linearly (0 = off).")
    overlong_penalty: float = Field(1.0, ge=0.0, description="overlong_buffer: the penalty of a response that "
                                    "uses every token allowed.")
    distill: DistillConfig = Field(default_factory=DistillConfig, description="On-policy distillation from a "
                                   "teacher model (algorithm.distill.teacher_path).")
