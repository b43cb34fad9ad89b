"""The typed schema of a training run: the single source of every default.

YAML files, `key=value` overrides, the legacy flags and the Python API all build this same object.
Every section forbids unknown keys so a typo fails loudly (with a suggestion) instead of being ignored.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from verl.algorithms.estimators import ESTIMATOR_NAMES, ESTIMATORS
from verl.algorithms.policy_losses import POLICY_LOSS_NAMES, POLICY_LOSSES
from verl.compat.keys import verl_name
from verl.config.fsdp import FSDPConfig
from verl.utils.cpu_matmul import CpuMatmul
from verl.utils.suggest import did_you_mean

# Threads (or worker processes) one setting may start: far above any host's cores, below what exhausts a host's
# thread limit and memory for stacks (100000 reward workers started 6,000 threads in a second before failing).
MAX_THREADS = 1024
MAX_SEED = 2**63 - 1  # torch.manual_seed and numpy take a seed of at most 64 bits


class Section(BaseModel):
    # allow_inf_nan=False: no float setting survives inf or nan (a learning rate of inf reaches the sampler as nan)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)


def _home(value: Any) -> Any:
    """`~/models/x` as the shell would expand it (volcengine/verl's own defaults are written that way)."""
    if isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    if isinstance(value, list):
        return [_home(v) for v in value]
    return value


def _split_csv(value: Any) -> Any:
    """Accept `0,1` / `"a.jsonl,b.jsonl"` (CLI style) as well as real lists; a scalar becomes a list of one."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.strip().strip("[]").split(",")]
        return [p for p in parts if p]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    return value


class LoraConfig(Section):
    """LoRA adapters (peft) on a model's linear layers; `rank: 0` trains every weight instead.

    With LoRA and no `ref.path`, the reference is the same model with its adapters switched off."""

    rank: int = Field(0, description="LoRA rank r; 0 = off (full fine-tune).")
    alpha: float | None = Field(None, description="LoRA scaling numerator (scale = alpha / rank); None = 2 x rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: str | list[str] = Field("all-linear", description="'all-linear' (every linear layer but the "
                                            "output head) or a list of module names, e.g. [q_proj, v_proj].")
    modules_to_save: list[str] | None = Field(None, description="Modules trained in full and saved with the "
                                              "adapter (e.g. [lm_head]).")
    _home = field_validator("path", mode="before")(_home)
    path: str | None = Field(None, description="An existing peft adapter folder to start from (its own rank, "
                                               "alpha and target modules apply).")

    _split = field_validator("modules_to_save", mode="before")(_split_csv)

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip() != "all-linear":
            return _split_csv(value)
        return value

    @property
    def enabled(self) -> bool:
        return self.rank != 0 or self.path is not None

    @property
    def scale_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank


class ModelConfig(Section):
    path: str = Field("tiny", description="HF model id or local dir; 'tiny' builds the local tiny model.")
    _home = field_validator("path", "tokenizer_path", mode="before")(_home)
    tokenizer_path: str | None = Field(None, description="Defaults to model.path (they must match).")
    chat_template: str | None = Field(None, description="Replace the tokenizer's chat template: 'hermes' (ChatML "
                                      "with the Hermes tool-call format, verl.data.tool_template.HERMES_TEMPLATE) or "
                                      "a path to a .jinja file. None = the tokenizer's own.")
    allow_tokenizer_mismatch: bool = Field(False, description="Accept a tokenizer_path whose vocabulary differs "
                                           "from model.path's own tokenizer (a warning instead of an error).")
    dtype: str = Field("auto", description="Dtype the weights are held in. auto = float32 master weights for "
                       "trained models (bfloat16 compute on GPUs with bfloat16, see fsdp.mixed_precision) and "
                       "bfloat16 frozen ones (reference, reward model) there; float32 on CPU. bfloat16/float16 "
                       "for a trained model needs model.low_precision_master_weights=true.")
    low_precision_master_weights: bool = Field(
        False, description="Train with model.dtype=bfloat16/float16 master weights and optimizer states anyway: "
        "an update smaller than the weight's rounding step (1/256 of it in bfloat16) is lost.")
    attn_implementation: str | None = Field(None, description="sdpa | eager | flash_attention_2; None = auto.")
    trust_remote_code: bool = False
    revision: str | None = None
    gradient_checkpointing: bool = False
    lora: LoraConfig = LoraConfig()


class MixtureSource(Section):
    """One source of `data.mixture`: files read like data.train_files, drawn with a relative weight."""

    name: str | None = Field(None, description="The source's name in metrics (reward/mean/<name>) and in each "
                             "row's `mixture` key; None = the first file's name without its extension.")
    files: list[str] = Field(default_factory=list, description="Files or folders, read like data.train_files "
                             "(each source has its own data report).")
    weight: float = Field(1.0, description="Relative share of each epoch's prompts (>= 0; the weights are "
                          "normalised, so 0.7/0.3 and 7/3 are the same mixture).")

    _split = field_validator("files", mode="before")(lambda v: _home(_split_csv(v)))

    @field_validator("weight")
    @classmethod
    def _weight(cls, v: float) -> float:
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"the weight is {v}; a mixture weight is a relative share, a number >= 0 (0 leaves the "
                             "source out)")
        return v

    @model_validator(mode="after")
    def _name(self) -> MixtureSource:
        if not self.files:
            raise ValueError("a mixture source needs files: [PATH, ...] (files or folders, read like "
                             "data.train_files)")
        if self.name is None:
            stem = os.path.basename(self.files[0].rstrip("/")).split(":")[0]
            self.__dict__["name"] = stem.split(".")[0] or stem
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.name):
            raise ValueError(f"name={self.name!r}: a mixture source name is used in metric names; use letters, "
                             "digits, '_', '-' or '.'")
        return self


class DataConfig(Section):
    train_files: list[str] = Field(default_factory=list)
    val_files: list[str] = Field(default_factory=list)
    kind: Literal["prompt", "sft", "preference"] = "prompt"
    fields: dict[str, str] = Field(default_factory=dict, description="canonical field -> source key/path")
    train_batch_size: int = Field(8, gt=0, description="Prompts per step (RL) or examples per step.")
    val_batch_size: int = Field(64, gt=0, description="Held-out prompts answered at once in validation; with "
                                "several actor ranks each answers a contiguous share of the rows.")
    max_prompt_length: int = Field(512, gt=0)
    max_response_length: int = Field(512, gt=0, description="SFT/DPO response tokens.")
    truncation: Literal["error", "drop", "truncate_left"] = "error"
    on_bad_row: Literal["error", "skip"] = "error"
    shuffle: bool = True
    apply_chat_template: Literal["auto", "always", "never"] = "auto"
    val_size: int = Field(0, ge=0, description="Rows held out from train_files when val_files is empty.")
    mixture: list[MixtureSource] = Field(
        default_factory=list, description="Training prompts from several sources with weights, instead of "
        "train_files: [{name, files, weight}, ...]; each epoch holds every source's share of prompts exactly "
        "(seeded, resumable), and the step logs reward/mean/<name> per source.")

    _split = field_validator("train_files", "val_files", mode="before")(lambda v: _home(_split_csv(v)))

    @model_validator(mode="after")
    def _mixture(self) -> DataConfig:
        if not self.mixture:
            return self
        problems = []
        if self.train_files:
            problems.append(f"data.mixture and data.train_files ({', '.join(self.train_files)}) are both set; the "
                            "mixture is the training data. Move the files into a mixture source "
                            "({files: [...], weight: ...}) or remove data.mixture")
        if sum(m.weight for m in self.mixture) <= 0:
            problems.append(f"data.mixture weights sum to 0 ({', '.join(f'{m.name}: {m.weight}' for m in self.mixture)}"
                            "); give at least one source a weight > 0")
        names = [m.name for m in self.mixture]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            problems.append(f"data.mixture names {', '.join(twice)} more than one source; give each source its "
                            "own name")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class EnvConfig(Section):
    name: str | None = Field(None, description="Built-in environment (e.g. 'arithmetic') or your class as "
                                                "'path/to/file.py:Class' / 'pkg.module:Class'; None = data files.")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    agent: str | None = Field(None, description="Agent code as 'path/to/agent.py:function': an async function(row, "
                              "base_url) that calls the policy through an OpenAI-compatible endpoint and returns the "
                              "episode's reward (None: the environment's reward over the last reply). Needs "
                              "pip install -e '.[agent]' in this checkout (`verl` on PyPI is another project).")
    agent_timeout_s: float = Field(60.0, gt=0.0, description="An agent episode running longer ends with reward 0.")
    agent_call_budget: int = Field(32, gt=0, description="Calls an agent episode may make (every call with its key "
                                   "counts, a malformed one too); more are refused (429).")
    agent_max_body_bytes: int = Field(1 << 20, gt=0, description="The largest request body the agent endpoint reads; "
                                      "a larger one is refused (413) before it is read.")
    agent_concurrency: int = Field(64, gt=0, le=MAX_THREADS, description="Agent episodes running at once (at most "
                                   f"{MAX_THREADS}: each holds a thread); 1 makes a run reproducible "
                                   "(concurrent agents' timing decides which calls are sampled together).")
    tool_call_format: str = Field("hermes", description="How the policy writes tool calls (hermes: Qwen2.5/Qwen3/"
                                  "Hermes <tool_call> tags, llama3_json: Llama 3.x): the endpoint returns them as "
                                  "OpenAI tool_calls.")


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
        4, gt=0, description="Responses per rank checked for drift when the step computes no old log-probs and "
        "the update's forward cannot check (a single on-policy update with dropout off checks every row it "
        "trains on, at no cost).")
    stop: list[str] = Field(default_factory=list, description="Multi-turn environments: a model turn ends at "
                            "the first of these strings (e.g. '</calc>') or at eos; the environment answers it.")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="vLLM engine settings (rollout.engine=vllm).")


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

    @model_validator(mode="before")
    @classmethod
    def _tis_alias(cls, data: Any) -> Any:
        return _tis_cap_alias(data)
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
                                       "or with gradient checkpointing.")
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
                                        "the actor's log-prob and update forwards, and those of a reference, critic and "
                                        "teacher on the actor's ranks; in SFT and DPO each example, "
                                        "the ranks of a group reading the same rows (not trainer.kind=rm). A "
                                        "micro-batch's sequences run as one row without padding; the memory plan divides activations and logits by it. "
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


def _function_specs(value: Any) -> Any:
    """`[numeric_match, reward.py:fn]` (names alone, as typed on a command line) as `[{name: ...}, ...]`."""
    if isinstance(value, (str, dict)):
        value = [value]
    if isinstance(value, list):
        return [{"name": v} if isinstance(v, str) else v for v in value]
    return value


class RewardConfig(Section):
    functions: list[dict[str, Any]] = Field(default_factory=list)
    _specs = field_validator("functions", mode="before")(_function_specs)
    model_path: str | None = None
    _home = field_validator("model_path", mode="before")(_home)
    model_dtype: str | None = None
    model_weight: float = 1.0
    model_batch_size: int = Field(16, gt=0, description="Sequences per reward-model forward (reward.model_path); "
                                  "a small reward model scores a whole step's responses faster in one batch.")
    workers: int = Field(4, ge=1, le=MAX_THREADS, description=f"Reward calls running at once (at most {MAX_THREADS}: "
                         "each is a thread or a process of its own), on threads (a per-sample function is one "
                         "call per sample; a batched or TRL-style function, a reward model or `remote` one call per "
                         "batch): slow rewards (code execution, HTTP) overlap instead of running one after another.")
    timeout_s: float = Field(60.0, gt=0.0, description="A reward call running longer is given up: its sample(s) score "
                             "0, counted in reward/timeouts, with the reason in samples.jsonl. Never retried: only "
                             "`remote` retries (its kwargs.retries, on connection errors and 5xx), within this same "
                             "limit, so keep it above kwargs.timeout_s x (retries + 1) plus back-off.")
    val_functions: list[dict[str, Any]] = Field(
        default_factory=list, description="Reward functions validation scores with instead of the training reward "
        "(reward.functions and reward.model_path), e.g. [numeric_match] to measure true held-out accuracy while a "
        "learned reward model trains the policy. Empty = validation scores as training does. Single-turn only.")
    _val_specs = field_validator("val_functions", mode="before")(_function_specs)
    executor: Literal["thread", "process"] = Field(
        "thread", description="Where per-sample reward functions run: `thread` (any callable) or `process` (worker "
        "processes: no GIL shared with generation, so CPU-bound rewards such as answer parsing run beside it, and a "
        "call past timeout_s is killed, not abandoned; the functions must be named in reward.functions or be "
        "importable). Batched and TRL-style functions run on threads either way.")
    max_worker_crashes: int = Field(8, ge=0, description="reward.executor=process: a worker process that dies in the "
                                    "middle of a call (os._exit, a signal, the OOM killer) fails only its sample, "
                                    "which scores 0 with the reason in samples.jsonl, counted in "
                                    "reward/worker_crashes, and a new worker takes its place; more crashes than this "
                                    "in one step stop the run (a RewardError naming the last one).")
    max_rss_mb: int = Field(4096, ge=0, description="reward.executor=process: a worker process whose resident "
                            "memory exceeds this many MiB after a call (a reward that leaks) is replaced by a "
                            "new one, counted in reward/worker_replacements; the call's result still counts. "
                            "0 = no limit. Keep it well above a fresh worker's size (what the functions load).")
    overlap: bool = Field(True, description="Start each response's per-sample reward calls as soon as it finishes "
                          "generating, while the rest of the batch is still sampled (single-turn rollouts on verl's "
                          "own engine); the scores are the same as with false (score after generation).")


class SandboxConfig(Section):
    require: list[str] = Field(default_factory=list, description="Isolation that model-written code (the code_exec "
                               "reward, the python tool) must have: any of network, pid, tmp, user, filesystem, memory "
                               "(verl.sandbox.FEATURES). A host that cannot give one refuses to start, naming the fix.")
    python: str | None = Field(None, description="The interpreter model-written code runs in; None = this one, or "
                               "the system's python3 when this one is not readable by an unprivileged uid.")


class DevicesConfig(Section):
    actor: list[int] | None = Field(None, description="Global ranks; None = every rank.")
    critic: list[int] | None = None
    ref: list[int] | None = None
    reward: list[int] | None = None
    teacher: list[int] | None = Field(None, description="Global ranks of the distillation teacher; None = every rank.")
    rollout: list[int] | None = Field(None, description="Ranks that only generate (asynchronous RL, "
                                      "rollout.max_staleness), apart from every training role; None = the actor "
                                      "generates between its updates.")
    num_gpus_per_node: int | None = Field(None, gt=0)
    allow_mixed_dtype: bool = False
    timeout_s: float = Field(600.0, gt=0.0)
    heartbeat_s: float = Field(60.0, ge=0.0, description="Seconds without a heartbeat after which every other rank "
                               "warns, once, that a rank stopped answering (stopped, or hung holding the GIL), naming "
                               "its last collective stage and step; a collective that needs it still fails at "
                               "timeout_s. 0 = off (e.g. while a debugger holds a rank).")

    _split = field_validator("actor", "critic", "ref", "reward", "teacher", "rollout", mode="before")(_split_csv)


class CheckpointConfig(Section):
    save_interval: int = Field(0, ge=0, description="Steps between saves; 0 = only at the end.")
    save_total_limit: int | None = Field(None, gt=0)
    async_save: bool = False
    keep_best: str | None = Field(None, description="A validation metric (val/pass@1, val/score, val/<source>/maj@4, "
                                  "...): the checkpoint of the best value so far is kept apart from the "
                                  "save_total_limit rotation, marked in `verl ckpt list` and checkpoints/best.json. "
                                  "A validation that improves it saves that step's checkpoint even off "
                                  "save_interval; the validation before training does not count. None = off.")
    keep_best_mode: Literal["max", "min"] = Field("max", description="Whether keep_best's best is its largest "
                                                  "(accuracy, pass@k) or smallest (a loss) value.")


class TrainerConfig(Section):
    kind: Literal["rl", "dpo", "sft", "rm"] = "rl"
    total_steps: int = Field(100, gt=0)
    seed: int = Field(42, ge=0, le=MAX_SEED, description="Seeds every generator of the run (0 to 2^63-1, the range "
                      "torch and numpy take).")
    run_dir: str | None = Field(None, description="None = runs/<kind>-<timestamp>.")
    resume: str = Field("auto", description="auto | never | PATH to a checkpoint.")

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_range(cls, v: Any) -> Any:
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not 0 <= v <= MAX_SEED:
            raise ValueError(f"a seed is a whole number from 0 to 2^63-1 ({MAX_SEED}), the range torch and numpy "
                             f"take; {v!r} is outside it")
        return v

    _home = field_validator("run_dir", "resume", mode="before")(_home)
    val_every: int = Field(0, ge=0, description="Validate every N steps; 0 = only at the end.")
    val_before_train: bool = True
    val_only: bool = Field(False, description="Validate once, on the checkpoint `trainer.resume` finds (or the "
                           "model as loaded), and stop: no training step, no checkpoint (volcengine/verl's key).")
    device: str = Field("auto", description="auto | cpu | cuda")
    log_every: int = Field(1, gt=0, description="Log (console line, JSONL row, backends) every N steps.")
    log_samples: int = Field(8, ge=0, description="Validation generations written to samples.jsonl (and "
                             "TensorBoard/wandb/MLflow) per validation; 0 = none.")
    cpu_threads: int | None = Field(None, gt=0, le=MAX_THREADS, description="torch CPU threads; 1 is fastest for "
                                    f"tiny models (at most {MAX_THREADS}).")
    cpu_matmul: CpuMatmul = Field(
        "auto", description="Library for float32 linear layers on CPU: auto = oneDNN where it is clearly faster on "
        "this host (at least 1.3x, the median of interleaved rounds, measured once and kept in "
        "$VERL_CACHE_DIR/cpu_matmul; AMD processors where MKL takes a generic path), else ATen; the environment "
        "variable VERL_CPU_MATMUL=aten|onednn decides auto instead; aten | onednn force one "
        "(verl.utils.cpu_matmul; benchmarks/cpu_matmul.py times both).")
    demo: Literal["arithmetic", "tool", "agent", "rlhf"] | None = Field(
        None, description="`verl train` runs this config as a demo: a supervised warm start, then RL, held-out "
        "accuracy before and after, summary.json. arithmetic = the built-in demo (env arithmetic), tool = the "
        "calculator tool demo (env calculator), agent = OpenAI-client agent code calling a calculator through "
        "the trainer's endpoint (env calculator + env.agent), rlhf = SFT, then a reward model on preferences "
        "(trainer.kind: rm), then RL on that reward model alone (env arithmetic).")


class LoggingConfig(Section):
    backends: list[str] = Field(default_factory=lambda: ["console", "jsonl"])
    project: str = "verl"
    experiment: str | None = None
    mlflow_tracking_uri: str | None = Field(None, description="MLflow tracking URI; None = a file store in "
                                            "<run_dir>/mlruns.")

    _split = field_validator("backends", mode="before")(_split_csv)


class DPOConfig(Section):
    beta: float = Field(0.1, gt=0.0)
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    precompute_ref: bool = False
    lr: float = Field(5e-7, gt=0.0)


class RMConfig(Section):
    """`trainer.kind: rm`: a Bradley–Terry reward model on preference pairs (data.kind: preference)."""

    lr: float = Field(1e-5, gt=0.0, description="Learning rate of the reward model (backbone and score head); "
                      "schedule, warm-up, weight decay and grad clipping come from actor.*.")
    center_rewards_coefficient: float = Field(
        0.0, ge=0.0, description="Adds c x mean((r_chosen + r_rejected)^2) to the loss (TRL's "
        "center_rewards_coefficient, e.g. 0.01): keeps the rewards centred on 0, which the pairwise loss alone "
        "leaves free. 0 = off.")
    export: bool = Field(True, description="At the end of training write <run_dir>/reward_model: a Hugging Face "
                         "AutoModelForSequenceClassification folder (num_labels=1, LoRA merged) that "
                         "reward.model_path, TRL and OpenRLHF load.")


class SFTConfig(Section):
    packing: bool = False
    lr: float = Field(1e-5, gt=0.0)
    epochs: int | None = Field(None, gt=0)
    steps: int | None = Field(None, gt=0, description="Optimizer steps of the demo's warm start / a fixed budget.")
    batch_size: int = Field(32, gt=0)


class RunConfig(Section):
    """The whole run. Build it with `verl.config.load_config` or `RunConfig(**dict)`."""

    _source_dir: str | None = PrivateAttr(None)  # the YAML's folder, where relative paths are also looked up

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    env: EnvConfig = EnvConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    actor: ActorConfig = ActorConfig()
    critic: CriticConfig = CriticConfig()
    ref: RefConfig = RefConfig()
    reward: RewardConfig = RewardConfig()
    sandbox: SandboxConfig = SandboxConfig()
    devices: DevicesConfig = DevicesConfig()
    fsdp: FSDPConfig = FSDPConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    trainer: TrainerConfig = TrainerConfig()
    logging: LoggingConfig = LoggingConfig()
    dpo: DPOConfig = DPOConfig()
    rm: RMConfig = RMConfig()
    sft: SFTConfig = SFTConfig()

    def resolve_path(self, path: str, what: str = "data file") -> str:
        """A user's relative path by the one rule for them (`verl.utils.user_code.resolve_user_path`: the
        working directory and the YAML's folder, found in exactly one), so `data/train.jsonl` next to a
        config works from anywhere; missing or ambiguous is a DataError naming both places tried."""
        from verl.errors import DataError
        from verl.utils.user_code import resolve_user_path

        return str(resolve_user_path(path, self._source_dir, what=what,
                                     fail=lambda msg: DataError(f"{msg} (data.train_files/val_files)")))

    @property
    def needs_critic(self) -> bool:
        """Whether the advantage estimator reads a learned critic's values (from the estimator table)."""
        return ESTIMATORS[self.algorithm.adv_estimator].needs_critic

    def offloads(self, role: str) -> bool:
        """Whether FSDP2 CPU offload applies to `role`'s model: `actor.cpu_offload` / `critic.cpu_offload` where
        set, else `fsdp.cpu_offload` (the reference, teacher and reward model follow `fsdp.cpu_offload`)."""
        own = getattr(getattr(self, role, None), "cpu_offload", None) if role in ("actor", "critic") else None
        return self.fsdp.cpu_offload if own is None else own

    @property
    def needs_ref(self) -> bool:
        return self.algorithm.kl_in_reward or self.actor.kl_loss_coef > 0

    @property
    def is_async(self) -> bool:
        """Whether rollout ranks of their own generate ahead of the trainer (`devices.rollout`)."""
        return self.devices.rollout is not None and self.trainer.kind == "rl"

    @property
    def needs_teacher(self) -> bool:
        """Whether an RL run distils from a teacher (`algorithm.distill.teacher_path`)."""
        return self.algorithm.distill.teacher_path is not None
