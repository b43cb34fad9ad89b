"""The documented import path for FSDP settings: `from verl.trainer.fsdp_config import FSDPConfig`.

The class lives in verl.config.fsdp so the config schema can embed it without importing the trainer.
"""

from verl.config.fsdp import FSDPConfig, MixedPrecisionSpec

__all__ = ["FSDPConfig", "MixedPrecisionSpec"]
