"""Loading the models a trainer runs: the policy, the frozen reference shared by RL and DPO, the teacher.

One reference builder means one tokenizer check: a reference with another vocabulary scores tokens it
does not share with the policy, which makes KL (RL) and the DPO margins meaningless without any error.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from verl.config.schema import RunConfig
from verl.data.datasets import pad_token_id
from verl.errors import ModelError
from verl.models.checks import LoadReport, vocabulary_difference
from verl.models.hf_loader import CONFIG_KEYS, load_hf_model_with_report
from verl.models.lora import AdapterOff, apply_lora, is_peft_model
from verl.models.reward_model import reward_model_from_causal_lm
from verl.models.sharded_load import adapters_off_meta, is_deferred
from verl.models.tiny import build_from_spec, is_tiny_spec
from verl.models.vision import is_vision_language, set_vision_trainable, vision_tower
from verl.utils.cpu_matmul import Product, describe, model_products, resolve, use_cpu_matmul
from verl.utils.tokenizer_protocol import Tokenizer


def resolve_model_path(path: str, *, key: str = "model.path", reward: bool = False) -> str:
    """`path`, where `tiny[:arch[:hidden[:layers]]]` is built locally (tests, the demo, offline use)."""
    return build_from_spec(path, key=key, reward=reward) if is_tiny_spec(path) else path


def load_policy_with_report(config: RunConfig, model_path: str, *, device: torch.device, dtype: torch.dtype,
                            tokenizer: Tokenizer | None = None, weights: bool = True, reward_head: bool = False,
                            defer: bool = False) -> tuple[torch.nn.Module, Tokenizer, LoadReport]:
    """The policy and its tokenizer as training loads them, with the model/tokenizer problems in the report
    (not raised), so `verl check` and the trainer's start-up list the same ones. `tokenizer`: the one the
    check pass loaded (not loaded again); `weights=False`: built on the meta device, nothing read;
    `reward_head`: the reward model `trainer.kind: rm` trains (a score head on the causal LM's backbone),
    with the LoRA adapters on that; `defer`: built on the meta device for a sharded role, each rank then
    reads its part of the weights when it is sharded (`verl.models.sharded_load`)."""
    cfg = config.model
    model, tokenizer, report = load_hf_model_with_report(
        model_path, tokenizer_name=cfg.tokenizer_path, attn_implementation=cfg.attn_implementation,
        torch_dtype=dtype, trust_remote_code=cfg.trust_remote_code, device=device, revision=cfg.revision,
        for_training=True, names=CONFIG_KEYS, tokenizer=tokenizer, weights=weights,
        defer=defer)  # messages name config keys
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if reward_head:
        model = with_score_head(model, tokenizer)
    model = with_lora(config, with_vision_setting(config, model), model_path,
                      task_type="SEQ_CLS" if reward_head else "CAUSAL_LM")
    return with_cpu_matmul(config, model, device).train(), tokenizer, report


def with_score_head(model: torch.nn.Module, tokenizer: Tokenizer) -> torch.nn.Module:
    """`model` as a reward model: a one-label sequence classifier as it is, a causal LM with a zero score head
    on its own backbone (`verl.models.reward_model.reward_model_from_causal_lm`)."""
    if is_peft_model(model):
        raise ModelError("a reward model to train was given with LoRA adapters already on it; pass the plain "
                         "model and set model.lora (the adapters then go on the backbone, the score head trains "
                         "in full)")
    if type(model).__name__.endswith("ForSequenceClassification"):
        labels = getattr(model.config, "num_labels", None)
        if labels != 1:
            raise ModelError(f"the reward model to train ({type(model).__name__}) has num_labels={labels}; a reward "
                             "model outputs one score. Fix: load it with num_labels=1, or pass the causal LM")
        return model
    return reward_model_from_causal_lm(model, pad_token_id(tokenizer))


def with_cpu_matmul(config: RunConfig, model: torch.nn.Module,
                    device: torch.device | None = None) -> torch.nn.Module:
    """`model` with its CPU linear layers on the library `trainer.cpu_matmul` picks (`verl.utils.cpu_matmul`);
    copies of it (a reference, a critic from the actor) keep that choice. On other devices, unchanged.
    `device`: where a model built on the meta device (its weights deferred) will live."""
    where = next(model.parameters(), torch.empty(0)).device
    if (device if where.type == "meta" and device is not None else where).type != "cpu":
        return model
    return use_cpu_matmul(model, cpu_matmul_choice(config, model)[0])


def run_products(config: RunConfig, model: torch.nn.Module) -> tuple[Product, ...]:
    """The products of `model`'s linear layers this run multiplies, which `trainer.cpu_matmul=auto` times: a
    training micro-batch's tokens (its token budget, or micro_batch_size full-length sequences) and, in RL,
    a decode step's rows (the batch's prompts x samples)."""
    data, actor, rl = config.data, config.actor, config.trainer.kind == "rl"
    length = data.max_prompt_length + (config.rollout.max_new_tokens if rl else data.max_response_length)
    update = actor.max_tokens_per_micro_batch or actor.micro_batch_size * length
    return model_products(model, update, data.train_batch_size * config.rollout.n if rl else 0)


def cpu_matmul_choice(config: RunConfig, model: torch.nn.Module) -> tuple[str, str]:
    """The CPU matmul library `trainer.cpu_matmul` means for `model` in this run, and why."""
    return resolve(config.trainer.cpu_matmul, run_products(config, model))


def describe_cpu_matmul(config: RunConfig, model: torch.nn.Module) -> str:
    """The line `verl check` and the run's banner print about it (`verl.utils.cpu_matmul.describe`)."""
    return describe(config.trainer.cpu_matmul, run_products(config, model))


def with_lora(config: RunConfig, model: torch.nn.Module, base_path: str | None = None, *,
              task_type: str = "CAUSAL_LM") -> torch.nn.Module:
    """The policy with `model.lora`'s adapters (base weights frozen), or unchanged when LoRA is off. With
    `task_type="SEQ_CLS"` (a reward model) peft trains the score head in full and saves it with the adapters."""
    lora = config.model.lora
    if not lora.enabled or is_peft_model(model):
        return model
    if config.model.gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # frozen embeddings: checkpointed layers still need a grad path
    vision = (vision_tower(model)[0], not config.actor.freeze_vision_tower) if is_vision_language(model) else None
    with adapters_off_meta() if is_deferred(model) else contextlib.nullcontext():
        return apply_lora(model, lora, base_model_name_or_path=base_path, task_type=task_type, vision=vision)


def with_vision_setting(config: RunConfig, model: torch.nn.Module) -> torch.nn.Module:
    """A vision-language policy with its tower frozen or trainable (`actor.freeze_vision_tower`); others as
    they are."""
    if is_vision_language(model):
        set_vision_trainable(model, not config.actor.freeze_vision_tower)
    return model


def given_policy(model: torch.nn.Module, tokenizer: Tokenizer | None, device: torch.device,
                 config: RunConfig | None = None, *,
                 reward_head: bool = False) -> tuple[torch.nn.Module, Tokenizer]:
    """A model object passed from Python, moved to the run's device; it must come with its tokenizer.
    With `model.lora` on (and `config` given) it gets its adapters here, as a loaded policy does;
    `reward_head`: as `load_policy_with_report` (a causal LM gets a score head on its own backbone, so
    training the reward model trains that backbone: pass a copy to keep the causal LM as it was)."""
    if tokenizer is None:
        raise ModelError("a model object was given without its tokenizer; pass tokenizer=... too "
                         "(they must come from the same source)")
    if reward_head:
        model = with_score_head(model, tokenizer)
    if config is not None:
        model = with_lora(config, with_vision_setting(config, model),
                          task_type="SEQ_CLS" if reward_head else "CAUSAL_LM")
        model = with_cpu_matmul(config, model.to(device))
    return model.to(device).train(), tokenizer


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """`model` in eval mode with no parameter requiring grad (a reference never trains)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def copy_in(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A deep copy of `model` whose parameters are frozen copies in `dtype`, made one parameter at a time (a
    float32 policy's bfloat16 reference never exists in float32 next to the policy). Tied weights stay tied."""
    memo: dict[int, Any] = {}
    for p in model.parameters():  # deepcopy takes a parameter it finds in `memo` instead of copying it
        memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
    return copy.deepcopy(model, memo)


def build_reference(config: RunConfig, policy: torch.nn.Module, tokenizer: Tokenizer, *, device: torch.device,
                    dtype: torch.dtype, given: torch.nn.Module | None = None, defer: bool = False) -> torch.nn.Module:
    """The frozen reference in `dtype`: `given`, else `ref.path`, else the policy's initial weights: with LoRA
    the policy itself with its adapters off (no copy), otherwise a copy. A copy of a policy whose weights are
    deferred (built on the meta device) is deferred too: it reads the same files when it is sharded.

    A `ref.path` model must share the policy's tokenizer vocabulary (ModelError otherwise: `load_frozen`);
    `defer`: as `load_frozen`.
    """
    if given is not None:
        return frozen(with_cpu_matmul(config, given.to(device=device, dtype=dtype)))
    path = config.ref.path
    if not path:
        return AdapterOff(policy) if is_peft_model(policy) else frozen(copy_in(policy, dtype))
    return load_frozen(config, path, tokenizer, key="ref.path", device=device, dtype=dtype, defer=defer)


def load_frozen(config: RunConfig, path: str, tokenizer: Tokenizer, *, key: str, device: torch.device,
                dtype: torch.dtype, defer: bool = False) -> torch.nn.Module:
    """A frozen causal LM from `path` (`key` names it in errors: `ref.path`, `algorithm.distill.teacher_path`)
    in `dtype`; it must share the policy's tokenizer vocabulary (the start-up checks compare the tokenizers
    before any weight loads; this catches a model passed around them). `defer`: built on the meta device,
    each rank reading its part when it is sharded (`load_hf_model_with_report`)."""
    cfg = config.model
    model, own_tokenizer, report = load_hf_model_with_report(
        resolve_model_path(path, key=key), attn_implementation=cfg.attn_implementation, torch_dtype=dtype,
        trust_remote_code=cfg.trust_remote_code, device=device, for_training=False, defer=defer)
    report.raise_if_problems()
    mismatch = vocabulary_difference(own_tokenizer, tokenizer, names=(key, "model.path"))
    if mismatch is not None:
        raise ModelError(tokenizer_mismatch_message(key, path, cfg.path, mismatch))
    return frozen(with_cpu_matmul(config, model if is_deferred(model) else model.to(device), device))


def tokenizer_mismatch_message(key: str, path: str, policy_path: str, mismatch: str) -> str:
    """Why a frozen model with another vocabulary is refused, both vocabularies named, and the fix."""
    what = "its log-probs of the policy's tokens" + (" (the KL to the reference)" if key == "ref.path" else
                                                      " (the distillation KL)")
    fix = ("use a reference from the same model family (same tokenizer), or leave ref.path empty to use the "
           "actor's initial weights" if key == "ref.path" else
           "use a teacher from the student's model family (same tokenizer; any size)")
    return (f"{key}={path!r} has a different tokenizer from model.path={policy_path!r} ({mismatch}), so {what} "
            f"would score other tokens than the ones sampled. Fix: {fix}.")

__all__ = ["build_reference", "copy_in", "cpu_matmul_choice", "describe_cpu_matmul", "frozen", "given_policy",
           "load_frozen", "load_policy_with_report", "resolve_model_path", "run_products",
           "tokenizer_mismatch_message", "with_cpu_matmul", "with_lora", "with_score_head",
           "with_vision_setting"]
