"""FSDP settings (re-exported as verl.trainer.fsdp_config.FSDPConfig).

Lives in the config layer so the typed run schema can embed it without importing the trainer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class MixedPrecisionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"


class FSDPConfig(BaseModel):
    """How a role's model is sharded with FSDP2 `fully_shard`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"] = "FULL_SHARD"
    mixed_precision: bool | MixedPrecisionSpec = False
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    limit_all_gathers: bool = True
    use_orig_params: bool = True
    hybrid_shard_size: int | None = None
