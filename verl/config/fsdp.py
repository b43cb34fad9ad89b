"""FSDP settings (re-exported as verl.trainer.fsdp_config.FSDPConfig).

Lives in the config layer so the typed run schema can embed it without importing the trainer. The field
names follow FSDP1 / volcengine-verl so existing configs keep working; `FSDPConfig.check` says which of
them still mean something under FSDP2 `fully_shard` instead of dropping them silently.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, field_validator

from verl.errors import ConfigError
from verl.utils.dtype import dtype_aliases, is_dtype_name, resolve_dtype


class MixedPrecisionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"

    @field_validator("param_dtype", "reduce_dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if not is_dtype_name(value):
            raise ValueError(f"unknown dtype {value!r}; use float32, bfloat16 or float16 "
                             f"(accepted spellings: {', '.join(dtype_aliases())})")
        return value


class FSDPConfig(BaseModel):
    """How a role's model is sharded with FSDP2 `fully_shard`.

    sharding_strategy maps onto FSDP2 like this:
      FULL_SHARD     1-D mesh over the role's ranks, reshard_after_forward=True (ZeRO-3)
      SHARD_GRAD_OP  1-D mesh, reshard_after_forward=False: parameters stay gathered from forward to
                     backward, trading memory for one all-gather less (ZeRO-2-like)
      HYBRID_SHARD   2-D mesh (replicate, shard): shard inside groups of `hybrid_shard_size` ranks
                     (default: ranks per node), replicate across them
      NO_SHARD       2-D mesh (replicate=all ranks, shard=1): every rank holds the full model and
                     gradients are all-reduced, i.e. DDP behaviour expressed with fully_shard
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    # "auto": bfloat16 compute with float32 reductions over float32 master weights on a GPU that has
    # bfloat16, off on CPU (verl.trainer.build.precision explains why masters stay float32).
    mixed_precision: bool | Literal["auto"] | MixedPrecisionSpec = "auto"
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    limit_all_gathers: bool = True
    use_orig_params: bool = True
    hybrid_shard_size: int | None = None

    @field_validator("hybrid_shard_size")
    @classmethod
    def _positive_shard_size(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"hybrid_shard_size must be >= 1, got {value}")
        return value

    # ----------------------------------------------------------------------------------------------
    # What the options become under FSDP2
    # ----------------------------------------------------------------------------------------------
    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2's knob behind FULL_SHARD vs SHARD_GRAD_OP (see class docstring)."""
        return self.sharding_strategy != "SHARD_GRAD_OP"

    def mixed_precision_dtypes(self, device_type: str = "cpu", *,
                               bf16_supported: bool | None = None) -> tuple[torch.dtype, torch.dtype] | None:
        """(param_dtype, reduce_dtype) for MixedPrecisionPolicy on `device_type`, or None when it is off.

        "auto" is on only on CUDA with bfloat16 (`bf16_supported`; default: asks torch), so a CPU run keeps
        computing in float32 and a GPU run computes in bfloat16 without holding its weights in it."""
        if self.mixed_precision is False:
            return None
        if self.mixed_precision == "auto":
            if device_type != "cuda":
                return None
            if bf16_supported is None:  # no GPU here: only a check of a GPU run (a login node) gets here, and
                # the GPUs it will run on are assumed to support bfloat16, as the A100/H100 class does
                bf16_supported = torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True
            if not bf16_supported:
                return None
        spec = (
            self.mixed_precision
            if isinstance(self.mixed_precision, MixedPrecisionSpec)
            else MixedPrecisionSpec()
        )
        return (
            resolve_dtype(spec.param_dtype, where="fsdp.mixed_precision.param_dtype"),
            resolve_dtype(spec.reduce_dtype, where="fsdp.mixed_precision.reduce_dtype"),
        )

    def shard_group_size(self, world_size: int, *, num_gpus_per_node: int | None = None) -> int:
        """How many ranks one copy of the parameters is split over (the inner mesh dimension)."""
        if self.sharding_strategy == "NO_SHARD":
            return 1
        if self.sharding_strategy == "HYBRID_SHARD":
            return self.hybrid_shard_size or num_gpus_per_node or world_size
        return world_size

    def check(
        self,
        world_size: int,
        uses_lora: bool = False,
        *,
        num_gpus_per_node: int | None = None,
        device_type: str = "cuda",
        key: str = "fsdp",
    ) -> list[str]:
        """Validate option combinations for a group of `world_size` ranks.

        Raises one ConfigError listing every impossible combination; returns notes for options that are
        accepted but mean nothing (or something different) under FSDP2, so the caller prints them
        instead of users believing a flag did something.
        """
        problems: list[str] = []
        notes: list[str] = []
        if world_size < 1:
            problems.append(f"{key}: the group has {world_size} ranks; a role needs at least one rank.")
        if uses_lora and not self.use_orig_params:
            problems.append(
                f"{key}.use_orig_params=False with LoRA: LoRA trains a few adapter parameters next to frozen "
                f"base weights, which needs per-parameter sharding. Fix: set {key}.use_orig_params=true."
            )
        if self.hybrid_shard_size is not None and self.sharding_strategy != "HYBRID_SHARD":
            problems.append(
                f"{key}.hybrid_shard_size={self.hybrid_shard_size} is only used with sharding_strategy=HYBRID_SHARD "
                f"(got {self.sharding_strategy}). Fix: set {key}.sharding_strategy=HYBRID_SHARD or remove "
                f"{key}.hybrid_shard_size."
            )
        if self.sharding_strategy == "HYBRID_SHARD" and world_size >= 1:
            shard = self.shard_group_size(world_size, num_gpus_per_node=num_gpus_per_node)
            if shard > world_size or world_size % shard != 0:
                problems.append(
                    f"{key}.sharding_strategy=HYBRID_SHARD with a shard group of {shard} ranks, but the group has "
                    f"{world_size} ranks, which is not a multiple of {shard}. Fix: set {key}.hybrid_shard_size to "
                    f"a divisor of {world_size} (e.g. {_largest_divisor_at_most(world_size, shard)}) or change "
                    f"the number of processes."
                )
            elif shard == world_size:
                notes.append(
                    f"{key}: HYBRID_SHARD with a shard group of all {world_size} ranks has one replica; it "
                    f"behaves like FULL_SHARD."
                )
        if isinstance(self.mixed_precision, MixedPrecisionSpec):
            try:
                self.mixed_precision_dtypes()
            except ConfigError as err:
                problems.append(str(err))
        if problems:
            raise ConfigError("Invalid FSDP configuration:\n" + "\n".join(f"  - {p}" for p in problems))

        if "limit_all_gathers" in self.model_fields_set or not self.limit_all_gathers:
            notes.append(
                f"{key}.limit_all_gathers={self.limit_all_gathers} has no effect under FSDP2: fully_shard "
                f"always bounds in-flight all-gathers itself."
            )
        if "use_orig_params" in self.model_fields_set or not self.use_orig_params:
            notes.append(
                f"{key}.use_orig_params={self.use_orig_params} has no effect under FSDP2: parameters are "
                f"always the original ones, sharded per parameter as DTensors."
            )
        if self.cpu_offload and device_type == "cpu":
            notes.append(
                f"{key}.cpu_offload=true has no effect when training on CPU: parameters already live there."
            )
        if self.sharding_strategy == "NO_SHARD":
            notes.append(
                f"{key}: NO_SHARD is run as fully_shard on a (replicate={world_size}, shard=1) mesh: every rank "
                f"keeps the whole model and gradients are all-reduced, like DDP."
            )
        return notes


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


__all__ = ["FSDPConfig", "MixedPrecisionSpec"]
