"""The sections of each model role: the optimizer step every trained model shares, the actor, critic and reference."""

from __future__ import annotations

import math
import warnings
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from verl.algorithms.policy_losses import POLICY_LOSS_NAMES, POLICY_LOSSES
from verl.compat.keys import verl_name
from verl.config.model_data import LoraConfig
from verl.config.section import Section, _home
from verl.utils.suggest import did_you_mean


class OptimConfig(Section):
    """Shared by actor and critic: what it takes to step one model."""

    lr: float = Field(1e-6, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    mini_batch_size: int | None = Field(None, gt=0, description="Prompts per optimizer step; None = whole batch.")
    micro_batch_size: int = Field(8, gt=0, description="Sequences per forward/backward (per device).")
    max_tokens_per_micro_batch: int | None = Field(
        None, gt=0, description="Token budget per micro-batch (padded prompt + response tokens): sequences are "
        "grouped by length under it instead of micro_batch_size at a time, so padding costs little. The "
        "gradient does not depend on the grouping. None = fixed micro_batch_size. Also sizes the no-grad "
        "log-prob / value passes (at twice the budget).")
    remove_padding: bool = Field(False, description="Run each micro-batch's sequences packed into one row without "
                                 "their padding (position ids restarting at 0 per sequence, no attention mask: "
                                 "transformers attends within each sequence), so a forward costs the real tokens, not "
                                 "rows x longest; same values and gradients up to float rounding. For the actor it "
                                 "covers the reference too and replaces share_prompt_forward; sequence parallelism "
                                 "takes precedence. Each model is probed once and refused if its attention does not "
                                 "follow packed position ids. verl's use_remove_padding, OpenRLHF's packing_samples.")
    ppo_epochs: int = Field(1, gt=0)
    grad_clip: float | None = Field(1.0, gt=0.0)
    shuffle: bool = True
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    disable_dropout: bool = Field(True, description="Zero every dropout in this model (RL, as TRL does): the "
                                  "PPO ratio then starts at exactly 1 and the update sees the sampling policy.")
    cpu_offload: bool | None = Field(None, description="FSDP2 CPU offload of this model's sharded parameters, "
                                     "gradients and optimizer states (torch's CPUOffloadPolicy: each layer is "
                                     "copied to the GPU for its forward/backward, the optimizer steps on the CPU). "
                                     "None = fsdp.cpu_offload. No effect when training on CPU.")
    activation_offload: bool = Field(False, description="Keep the tensors this model's forward saves for backward in "
                                     "pinned host memory (torch.autograd.graph.save_on_cpu) and copy them back in "
                                     "the backward: GPU memory for activations drops to about one layer's, at the "
                                     "cost of host-device copies; same gradients. With fsdp.activation_checkpointing "
                                     "only the layer inputs are offloaded. No effect when training on CPU.")


class RolloutCorrectionConfig(Section):
    """`actor.rollout_correction`: weigh or reject tokens by pi_old / pi_rollout, the trainer's probability of a
    sampled token over the sampler's (verl.algorithms.rollout_correction)."""

    mode: Literal["auto", "off", "token_tis", "seq_tis", "seq_tis_geo", "token_mask", "seq_mask"] = Field(
        "auto", description="auto = token_tis where the sampler can differ from the trainer (rollout.engine=vllm, "
        "bfloat16/float16 compute, a stale engine), off where it cannot (the hf engine on the trainer's float32 "
        "weights: the update is then bit-identical to off). token_tis / seq_tis / seq_tis_geo: each token's loss "
        "times min(ratio, cap), the ratio per token, of the whole response (product) or its geometric mean. "
        "token_mask / seq_mask: leave out tokens (responses, by their geometric-mean ratio) whose ratio is "
        "outside [lo, hi]. `verl check` prints the mode a run gets and why.")
    cap: float = Field(2.0, gt=0.0, description="*_tis: the most a token's weight can be.")
    lo: float = Field(0.5, gt=0.0, description="*_mask: the smallest ratio kept.")
    hi: float = Field(2.0, gt=0.0, description="*_mask: the largest ratio kept.")

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML reads a bare `off` as false

    @model_validator(mode="after")
    def _band(self) -> RolloutCorrectionConfig:
        if not self.lo < 1.0 < self.hi:
            raise ValueError(f"actor.rollout_correction: lo={self.lo} and hi={self.hi} must hold 1 between them "
                             "(lo < 1 < hi), else even a sampler that matches the trainer exactly is rejected")
        return self


def _tis_cap_alias(data: Any) -> Any:
    """The deprecated `actor.tis_cap: X` is `actor.rollout_correction: {mode: token_tis, cap: X}`."""
    if not isinstance(data, dict) or data.get("tis_cap") is None:
        return data
    data = dict(data)
    cap = data.pop("tis_cap")
    given = data.get("rollout_correction") or {}
    given = given.model_dump(exclude_unset=True) if isinstance(given, BaseModel) else dict(given)
    if given.get("mode", "auto") not in ("auto", "token_tis") or "cap" in given:
        raise ValueError(f"actor.tis_cap={cap} (deprecated) and actor.rollout_correction={given} both set the "
                         "rollout correction; keep only actor.rollout_correction")
    warnings.warn(f"actor.tis_cap is deprecated: use actor.rollout_correction.mode=token_tis and "
                  f"actor.rollout_correction.cap={cap} (applied so for this run)", FutureWarning, stacklevel=2)
    data["rollout_correction"] = {**given, "mode": "token_tis", "cap": cap}
    return data


class ActorConfig(OptimConfig):
    policy_loss: str = Field("ppo", description="The policy loss, by name from verl.algorithms.policy_losses: "
                             f"{', '.join(POLICY_LOSS_NAMES)} (table in docs/training.md). Its options go in "
                             "loss_options; actor.importance_sampling: sequence (old) means gspo.")
    loss_options: dict[str, Any] = Field(default_factory=dict, description="Options of the chosen policy_loss "
                                         "(e.g. {fraction: 2e-4} for clip_cov); an option left out takes the "
                                         "loss's default, one the loss does not have is refused.")
    clip_low: float | None = Field(None, gt=0.0, description="Short for loss_options.clip_low (ppo, gspo, cispo, "
                                   "gmpo); None = the loss's default (ppo: 0.2).")
    clip_high: float | None = Field(None, gt=0.0, description="Short for loss_options.clip_high (ppo, gspo, "
                                    "cispo, gmpo); None = the loss's default (ppo: 0.2; 0.28 is DAPO's "
                                    "clip-higher).")
    dual_clip: float | None = Field(None, gt=1.0, description="Short for loss_options.dual_clip (ppo only): "
                                    "dual-clip constant c (> 1); None = off.")

    @model_validator(mode="before")
    @classmethod
    def _importance_sampling(cls, data: Any) -> Any:
        """The old `importance_sampling: token | sequence` key: sequence is policy_loss gspo (keeping the old
        clip default 0.2 unless a clip range is set), token is the default ppo."""
        if not isinstance(data, dict) or "importance_sampling" not in data:
            return data
        data = dict(data)
        old = data.pop("importance_sampling")
        if old not in ("token", "sequence"):
            raise ValueError(f"importance_sampling={old!r} (deprecated) must be token or sequence; "
                             "use policy_loss: ppo or gspo instead")
        wanted = "gspo" if old == "sequence" else "ppo"
        loss = data.setdefault("policy_loss", wanted)
        if loss != wanted:
            raise ValueError(f"importance_sampling: {old} (deprecated; it means policy_loss: {wanted}) contradicts "
                             f"policy_loss: {loss}; remove importance_sampling")
        options = data.get("loss_options") or {}
        if wanted == "gspo":
            for key in ("clip_low", "clip_high"):
                if data.get(key) is None and key not in options:
                    data[key] = 0.2  # what importance_sampling: sequence clipped with
        warnings.warn(f"actor.importance_sampling is deprecated: use actor.policy_loss: {wanted}"
                      + (" (gspo's own default clip range is the paper's 3e-4 / 4e-4; this run keeps 0.2 / 0.2 "
                         "unless it sets actor.clip_low / clip_high)" if wanted == "gspo" else ""),
                      FutureWarning, stacklevel=2)
        return data

    @field_validator("loss_options", mode="before")
    @classmethod
    def _numbers(cls, options: Any) -> Any:
        """YAML 1.1 reads `2e-4` as text; a loss option meant as a number is one."""
        if not isinstance(options, dict):
            return options
        out = {}
        for key, value in options.items():
            if isinstance(value, str):
                try:
                    value = float(value)
                except ValueError:
                    pass
            out[key] = value
        return out

    @field_validator("policy_loss")
    @classmethod
    def _known_loss(cls, name: str) -> str:
        if name not in POLICY_LOSSES:
            raise ValueError(f"{name!r} is not a registered policy loss.{did_you_mean(name, POLICY_LOSSES)} "
                             f"Registered: {', '.join(POLICY_LOSSES)}")
        return name

    @model_validator(mode="after")
    def _loss_options(self) -> ActorConfig:
        loss = POLICY_LOSSES[self.policy_loss]
        problems = loss.problems(self.loss_options, did_you_mean)
        for key in ("clip_low", "clip_high", "dual_clip"):
            value = getattr(self, key)
            if value is None:
                continue
            if key in self.loss_options:
                problems.append(f"{key} is set twice, as actor.{key} and actor.loss_options.{key}; keep one")
            elif key not in loss.options:
                problems.append(f"actor.{key} is not an option of policy_loss {loss.name}. Its options: "
                                f"{', '.join(loss.options) or 'none'}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def loss_kwargs(self) -> dict[str, Any]:
        """The chosen loss's options: its defaults, overridden by loss_options and the short keys."""
        options = POLICY_LOSSES[self.policy_loss].defaults() | self.loss_options
        for key in ("clip_low", "clip_high", "dual_clip"):
            if getattr(self, key) is not None:
                options[key] = getattr(self, key)
        return options

    mask_truncated: bool = Field(False, description="Leave responses that rollout.max_new_tokens cut off (no eos) "
                                 "out of the policy loss (DAPO's overlong filtering; TRL's "
                                 "mask_truncated_completions).")
    tis_cap: float | None = Field(None, gt=0.0, description="Deprecated: actor.rollout_correction with mode "
                                  "token_tis and this cap (what a value here is translated to).")
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig, description="Correction for a sampler whose log-probs differ "
        "from the trainer's (vLLM, bf16, stale weights); on by default where they can differ.")

    old_logprobs: Literal["auto", "recompute", "sampler"] = Field(
        "auto", description="The old policy's log-probs, where the update needs them (several mini-batches or "
        "epochs, a KL, distillation): recompute = a no-grad forward of the actor over every response; sampler = "
        "the log-probs the rollout sampled with (verl's bypass mode: no pass, and no rollout correction, which "
        "then has nothing to correct); auto = sampler where the sampler is our hf engine on the trainer's own "
        "float32 weights (its log-probs are the trainer's up to rounding), with no top-k/top-p and no explicit "
        "rollout_correction, else recompute. With sampler, the update's forwards before its first optimizer step "
        "(on the weights that sampled) still measure the drift every step, so the stale-engine guard holds.")

    @model_validator(mode="before")
    @classmethod
    def _tis_alias(cls, data: Any) -> Any:
        return _tis_cap_alias(data)

    @model_validator(mode="after")
    def _sampler_has_nothing_to_correct(self) -> ActorConfig:
        if self.old_logprobs == "sampler" and self.rollout_correction.mode not in ("auto", "off"):
            raise ValueError(
                f"actor.old_logprobs=sampler makes the sampler's log-probs the old policy, so "
                f"actor.rollout_correction.mode={self.rollout_correction.mode} has nothing to correct (its ratio "
                "pi_old / pi_rollout is 1). Fix: actor.old_logprobs=recompute to correct the sampler towards the "
                "trainer, or actor.rollout_correction.mode=auto")
        return self
    kl_loss_coef: float = Field(0.0, ge=0.0, description="> 0 adds KL to the reference as a loss term.")
    kl_loss_type: Literal["k1", "k2", "k3", "abs"] = "k3"
    _verl_kl = field_validator("kl_loss_type", mode="before")(verl_name("kl_type"))
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus: loss -= entropy_coef x mean token entropy. "
                                "With target_entropy, the adaptive coefficient's starting value.")
    target_entropy: float | None = Field(None, description="Adaptive entropy bonus: after each update the "
                                         "coefficient moves by entropy_coef_step x (target_entropy - measured mean "
                                         "token entropy, nats), clipped to [0, entropy_coef_max]; checkpointed. "
                                         "None = the fixed entropy_coef.")
    entropy_coef_step: float = Field(1e-3, gt=0.0, description="target_entropy: coefficient change per nat of "
                                     "entropy below (or above) the target, per step.")
    entropy_coef_max: float = Field(0.01, ge=0.0, description="target_entropy: the coefficient's upper bound.")
    entropy_top_fraction: float = Field(1.0, description="Train the policy-gradient loss on the highest-entropy "
                                        "fraction of each micro-batch's response tokens only (0.2: the 'forking "
                                        "tokens' of arXiv 2506.01939); the others keep their place in the loss "
                                        "normaliser. 1.0 = every token.")

    @field_validator("target_entropy")
    @classmethod
    def _positive_target(cls, v: float | None) -> float | None:
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"actor.target_entropy={v} must be a positive number of nats per token (a policy's "
                             "entropy is > 0 until it collapses). Fix: set e.g. actor.target_entropy=0.3, or null "
                             "for the fixed actor.entropy_coef")
        return v

    @field_validator("entropy_top_fraction")
    @classmethod
    def _fraction(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"actor.entropy_top_fraction={v} must lie in (0, 1]: the share of each micro-batch's "
                             "tokens (highest entropy first) the policy loss trains on. Fix: 0.2 for the "
                             "high-entropy minority (arXiv 2506.01939), 1.0 for every token")
        return v

    share_prompt_forward: bool = Field(True, description="With rollout.n > 1, run each group's prompt once per "
                                       "micro-batch (with gradient) and its n responses on the prompt's cached "
                                       "keys/values; same loss and gradients as the unshared forward. Mini-batches "
                                       "then shuffle whole groups. Off for models without a KV cache argument "
                                       "or with gradient checkpointing. DPO and reward models: a pair's prompt once, "
                                       "with both answers in the same row of one forward (each masked from the "
                                       "other) under sdpa attention, gradient checkpointing or not; else DPO's "
                                       "answers run on the prompt's cached keys/values and a reward model's pairs "
                                       "whole.")
    freeze_vision_tower: bool = Field(False, description="A vision-language policy's vision tower (its image "
                                      "encoder and merger) stays as loaded; false trains it with the language "
                                      "model (in full: under LoRA, the adapters go on the language model only and "
                                      "the tower trains as a module saved with them). verl's freeze_vision_tower.")
    chunked_logprobs: bool | Literal["auto"] = Field(
        "auto", description="Compute the log-probs and entropy of the policy (and reference, teacher) from the "
        "output head's input, one chunk of tokens at a time in forward and backward (the backward recomputes each "
        "chunk's logits), so a micro-batch's [tokens, vocabulary] logits never exist: 9.7 GB in float32 for one "
        "16k-token response at Qwen2.5's vocabulary. Same values and gradients up to float rounding; one more "
        "head projection per backward. auto = on where a micro-batch's response logits (response tokens x "
        "vocabulary, as the memory plan counts them) reach 2^28 and the head is one linear projection; true = on "
        "(refused for other heads); false = off. SFT and DPO take it for their target tokens (auto counting "
        "actor.micro_batch_size x (max_prompt_length + max_response_length) positions).")
    skip_zero_advantage: bool = Field(True, description="Without a KL loss or an entropy bonus, a sequence whose "
                                      "advantages are all 0 adds exactly nothing to the gradient: skip its forward "
                                      "and backward (the loss normaliser still counts it). Metric actor/skipped_frac.")
    sequence_parallel_size: int = Field(1, ge=1, description="Ulysses sequence parallelism: each of the actor's "
                                        "sequences is split along its tokens over this many consecutive actor ranks "
                                        "(all-to-all over attention heads), so one rank holds 1/S of every layer's "
                                        "activations. Must divide the actor's ranks and the model's attention heads; "
                                        "the actor's log-prob and update forwards, and those of a reference, "
                                        "critic and teacher on the actor's ranks; in SFT and DPO each example, "
                                        "the ranks of a group reading the same rows (not trainer.kind=rm). A "
                                        "micro-batch's sequences run as one row without padding; the memory plan "
                                        "divides activations and logits by it. 1 = off. See docs/multigpu.md.")
    tensor_parallel_size: int = Field(1, ge=1, description="Tensor parallelism (DTensor, Megatron-style): each of "
                                      "the actor's decoder layers, its embedding and its head are split over this "
                                      "many consecutive actor ranks (attention by heads, the MLP by its "
                                      "intermediate size, the head by the vocabulary, whose log-probs are computed "
                                      "from the shards); FSDP2 shards over the rest (actor ranks / T data-parallel "
                                      "replicas, each reading its own rows). The reference follows the actor's "
                                      "mesh, and so does vLLM (the group's engines are one engine split T ways). "
                                      "Must divide the actor's ranks and the model's heads, key/value heads, "
                                      "intermediate size and vocabulary; Qwen2, Qwen3 and Llama models, RL only. "
                                      "Not yet combined with LoRA, sequence_parallel_size > 1, remove_padding, "
                                      "chunked_logprobs=true, CPU offload, HYBRID_SHARD/"
                                      "NO_SHARD, a critic, or roles on ranks of their own (verl check refuses them). "
                                      "1 = off. See docs/multigpu.md.")


class CriticConfig(OptimConfig):
    lr: float = Field(1e-5, gt=0.0)
    path: str | None = Field(None, description="Value model init; None = copy of the actor's backbone.")
    _home = field_validator("path", mode="before")(_home)
    value_clip: float | None = Field(0.5, gt=0.0)
    warmup_steps_critic_only: int = Field(0, ge=0, description="Steps that update only the critic.")
    share_prompt_forward: bool = Field(True, description="With rollout.n > 1, the value pass and the critic "
                                       "update run each group's prompt once per micro-batch and its n responses "
                                       "on the prompt's cached keys/values; same values, loss and gradients as "
                                       "the unshared forward. Critic mini-batches then shuffle whole groups. "
                                       "Off for backbones without a KV cache argument or with gradient "
                                       "checkpointing.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA on the value model's backbone "
                             "(the value head always trains in full).")


class RefConfig(Section):
    path: str | None = Field(None, description="Reference policy; None = the actor's initial weights (with "
                             "LoRA: the actor with its adapters off, no second copy).")
    _home = field_validator("path", mode="before")(_home)
