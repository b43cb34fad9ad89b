"""Typed run configuration: schema, YAML loading, overrides, legacy flags."""

from verl.config.fsdp import FSDPConfig
from verl.config.loader import LEGACY_FLAGS, build_config, config_to_yaml, load_config, split_legacy_flags
from verl.config.schema import RunConfig

__all__ = [
    "FSDPConfig",
    "LEGACY_FLAGS",
    "RunConfig",
    "build_config",
    "config_to_yaml",
    "load_config",
    "split_legacy_flags",
]
