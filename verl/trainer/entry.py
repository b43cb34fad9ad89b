"""The trainer for `trainer.kind` (what `verl train CONFIG` builds; the demos live in `verl.demos`)."""

from __future__ import annotations

from verl.config.schema import RunConfig
from verl.trainer.dpo_trainer import DPOTrainer
from verl.trainer.rl_trainer import RLTrainer
from verl.trainer.rm_trainer import RMTrainer
from verl.trainer.runtime import TrainerRuntime
from verl.trainer.sft_trainer import SFTTrainer


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
