"""FSDPConfig combination rules and the FSDP2 translation (pure, no processes)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from verl.config.fsdp import FSDPConfig, MixedPrecisionSpec
from verl.errors import ConfigError
from verl.trainer.fsdp_config import FSDPConfig as ReExported


def test_trainer_path_reexports_the_same_class():
    assert ReExported is FSDPConfig


def test_defaults_are_valid_and_silent():
    assert FSDPConfig().check(world_size=2) == []


def test_lora_requires_use_orig_params():
    with pytest.raises(ConfigError) as info:
        FSDPConfig(use_orig_params=False).check(world_size=2, uses_lora=True)
    assert "fsdp.use_orig_params=False with LoRA" in str(info.value)
    assert "Fix: set fsdp.use_orig_params=true" in str(info.value)


def test_hybrid_shard_needs_divisible_world():
    cfg = FSDPConfig(sharding_strategy="HYBRID_SHARD", hybrid_shard_size=4)
    with pytest.raises(ConfigError) as info:
        cfg.check(world_size=6)
    msg = str(info.value)
    assert "HYBRID_SHARD with a shard group of 4 ranks, but the group has 6 ranks" in msg
    assert "a divisor of 6 (e.g. 3)" in msg
    assert cfg.check(world_size=8) == []


def test_hybrid_shard_defaults_to_gpus_per_node():
    cfg = FSDPConfig(sharding_strategy="HYBRID_SHARD")
    assert cfg.shard_group_size(8, num_gpus_per_node=4) == 4
    with pytest.raises(ConfigError, match="shard group of 4 ranks, but the group has 6"):
        cfg.check(world_size=6, num_gpus_per_node=4)
    assert "behaves like FULL_SHARD" in cfg.check(world_size=4)[0]


def test_hybrid_shard_size_without_hybrid_is_an_error():
    with pytest.raises(
        ConfigError, match="hybrid_shard_size=2 is only used with sharding_strategy=HYBRID_SHARD"
    ):
        FSDPConfig(hybrid_shard_size=2).check(world_size=4)


def test_options_without_meaning_under_fsdp2_are_reported():
    notes = FSDPConfig(limit_all_gathers=False, use_orig_params=True).check(world_size=2)
    assert any(n.startswith("fsdp.limit_all_gathers=False has no effect under FSDP2") for n in notes)
    assert any(n.startswith("fsdp.use_orig_params=True has no effect under FSDP2") for n in notes)
    notes = FSDPConfig(cpu_offload=True).check(world_size=2, device_type="cpu")
    assert notes == [
        "fsdp.cpu_offload=true has no effect when training on CPU: parameters already live there."
    ]
    assert FSDPConfig(cpu_offload=True).check(world_size=2, device_type="cuda") == []
    assert "like DDP" in FSDPConfig(sharding_strategy="NO_SHARD").check(world_size=2)[0]


def test_fsdp2_translation():
    assert FSDPConfig().reshard_after_forward is True
    assert FSDPConfig(sharding_strategy="SHARD_GRAD_OP").reshard_after_forward is False
    assert FSDPConfig().mixed_precision_dtypes() is None
    assert FSDPConfig(mixed_precision=True).mixed_precision_dtypes() == (torch.bfloat16, torch.float32)
    spec = MixedPrecisionSpec(param_dtype="fp16", reduce_dtype="bf16")
    assert FSDPConfig(mixed_precision=spec).mixed_precision_dtypes() == (torch.float16, torch.bfloat16)
    assert FSDPConfig(sharding_strategy="NO_SHARD").shard_group_size(4) == 1
    assert FSDPConfig().shard_group_size(4) == 4


def test_schema_rejects_bad_values():
    with pytest.raises(ValidationError):
        FSDPConfig(sharding_strategy="ZERO3")
    with pytest.raises(ValidationError):
        FSDPConfig(hybrid_shard_size=0)
    with pytest.raises(ValidationError):
        MixedPrecisionSpec(param_dtype="float8")
    with pytest.raises(ValidationError):
        FSDPConfig(limit_all_gather=True)  # typo: extra keys are forbidden
