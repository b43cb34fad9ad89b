"""Which dtype each role holds its weights in and computes in: the one place `auto` is resolved.

A trained model keeps float32 master weights (so float32 gradients and AdamW moments too): bfloat16 has 8
significant bits, so an update smaller than about 1/256 of a weight rounds back to the same weight, and at
lr 1e-6 most of them are that small. On a GPU the forward and backward still run in bfloat16, through
FSDP2's MixedPrecisionPolicy (`fsdp.mixed_precision=auto`: bfloat16 parameters in compute, float32
gradient reductions). A frozen model (reference, reward model) only runs forwards: it is held in the
dtype the actor computes in. `verl check` and the trainer both call `resolve_precision`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl.config.schema import RunConfig
from verl.errors import ConfigError, VerlError
from verl.utils.dtype import resolve_dtype

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Precision:
    """The dtypes of a run on one device type."""

    master: torch.dtype  # trained roles (actor, critic): parameters, gradients, optimizer states
    frozen: torch.dtype  # reference (and the reward model without reward.model_dtype): weights
    mixed: tuple[torch.dtype, torch.dtype] | None  # FSDP2 (param_dtype, reduce_dtype); None = off

    @property
    def compute(self) -> torch.dtype:
        """The dtype trained roles run their forward and backward in."""
        return self.mixed[0] if self.mixed is not None else self.master

    def describe(self) -> str:
        if self.mixed is None:
            return f"trained weights in {_name(self.master)}, computed in {_name(self.master)}"
        return (f"{_name(self.master)} master weights and optimizer states, {_name(self.mixed[0])} compute, "
                f"{_name(self.mixed[1])} gradient reductions (fsdp.mixed_precision)")


def resolve_precision(config: RunConfig, device_type: str, *, bf16_supported: bool | None = None) -> Precision:
    """`model.dtype` and `fsdp.mixed_precision` for `device_type` ("auto": float32 masters; on a GPU with
    bfloat16 (`bf16_supported`, default: asks torch), bfloat16 compute). Unknown spellings raise ConfigError."""
    name = config.model.dtype
    master = torch.float32 if name == "auto" else resolve_dtype(name, where="model.dtype")
    mixed = config.fsdp.mixed_precision_dtypes(device_type, bf16_supported=bf16_supported)
    return Precision(master=master, frozen=mixed[0] if mixed is not None else master, mixed=mixed)


def trained_roles(config: RunConfig, kind: str) -> list[str]:
    """The roles whose full weights an optimizer updates (LoRA trains float32 adapters, not the weights)."""
    roles = [] if config.model.lora.enabled else ["actor"]
    if kind == "rl" and config.needs_critic:
        roles.append("critic")
    return roles


def check_master_precision(config: RunConfig, precision: Precision, kind: str) -> list[ConfigError]:
    """bfloat16/float16 master weights for a trained role are refused unless the user insists: the step's
    updates below the weights' rounding step are silently lost."""
    roles = trained_roles(config, kind)
    if precision.master not in LOW_PRECISION or not roles or config.model.low_precision_master_weights:
        return []
    dtype = _name(precision.master)
    bits = 8 if precision.master == torch.bfloat16 else 11
    return [ConfigError(
        f"model.dtype={config.model.dtype} would hold the {' and '.join(roles)}'s master weights and optimizer "
        f"states in {dtype}: it keeps {bits} significant bits, so an update smaller than 1/{2 ** bits} of a "
        f"weight rounds away and the weight does not move (at lr 1e-6 most updates are that small). Fix: "
        f"model.dtype=auto (float32 master weights; on a GPU the compute is still bfloat16 through "
        f"fsdp.mixed_precision=auto), or set model.low_precision_master_weights=true to train in {dtype} anyway")]


def role_dtype_names(config: RunConfig, device_type: str, *, held: bool = False,
                     bf16_supported: bool | None = None) -> dict[str, str | None]:
    """The dtype every active role computes in ('auto' resolved for this device, as the trainer does: a
    trained role with float32 masters and bfloat16 mixed precision computes in bfloat16, like the frozen
    reference); `held=True`: the dtype its weights are held in (the memory estimate's)."""
    try:
        precision = resolve_precision(config, device_type, bf16_supported=bf16_supported)
    except VerlError:  # an unknown spelling: passed on as written, the mapping reports it with its key
        precision = None

    def name(dtype: torch.dtype) -> str:
        return str(dtype).removeprefix("torch.")

    reward_dtype = config.reward.model_dtype
    if precision is None:
        actor = trained = config.model.dtype
        reference = reward = reward_dtype or actor
    else:
        actor = name(precision.compute)
        trained = name(precision.master) if held else actor
        reference = name(precision.frozen)
        reward = reward_dtype if reward_dtype and reward_dtype != "auto" else reference
    return {"actor": trained, "critic": trained, "ref": reference,
            "reward": reward if config.reward.model_path else None,
            "teacher": reference if config.needs_teacher else None, "rollout": actor if config.is_async else None}


__all__ = ["LOW_PRECISION", "Precision", "check_master_precision", "resolve_precision", "role_dtype_names",
           "trained_roles"]


def compute_dtype(config: RunConfig, device_type: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the policy computes in: the resolved precision's, or the model's own when it was given in a
    low precision (a model handed over in bfloat16 computes in it whatever the config says)."""
    return model_dtype if model_dtype in LOW_PRECISION else resolve_precision(config, device_type).compute
