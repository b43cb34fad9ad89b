"""verl: reinforcement-learning post-training for Hugging Face causal language models.

`import verl` stays light: the trainers and the model loader are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from verl.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DeviceMappingError,
    DistributedError,
    ModelError,
    RewardError,
    VerlError,
)

__version__ = "0.1.0"

_LAZY = {
    "RLTrainer": "verl.trainer.rl_trainer",
    "DPOTrainer": "verl.trainer.offline.dpo_trainer",
    "SFTTrainer": "verl.trainer.offline.sft_trainer",
    "RMTrainer": "verl.trainer.offline.rm_trainer",
    "load_hf_model": "verl.utils.hf_loader",  # the documented path (a re-export)
    "FSDPConfig": "verl.trainer.fsdp_config",
    "RunConfig": "verl.config.schema",
    "load_config": "verl.config.loader",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'verl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DeviceMappingError",
    "DistributedError",
    "ModelError",
    "RewardError",
    "VerlError",
    *_LAZY,
]
