"""The trainer for `trainer.kind` (what `verl train CONFIG` builds; the demos live in `verl.demos`)."""

from __future__ import annotations

from verl.config.schema import RunConfig
from verl.trainer.compose.runtime import TrainerRuntime
from verl.trainer.offline.dpo_trainer import DPOTrainer
from verl.trainer.offline.rm_trainer import RMTrainer
from verl.trainer.offline.sft_trainer import SFTTrainer
from verl.trainer.rl_trainer import RLTrainer


def build_trainer(config: RunConfig) -> TrainerRuntime:
    kind = config.trainer.kind
    if kind == "rl":
        return RLTrainer(config)
    if kind == "dpo":
        return DPOTrainer(config)
    if kind == "rm":
        return RMTrainer(config)
    return SFTTrainer(config)


__all__ = ["build_trainer"]
