"""`verl train`: pick the trainer for `trainer.kind`, or run a demo: the built-in one when there is no config,
the one `trainer.demo` names otherwise."""

from __future__ import annotations

import os
import sys

from verl.checkpoint import TrainingInterrupted
from verl.config.schema import RunConfig
from verl.distributed.process import shutdown_distributed
from verl.trainer.demo import run_demo
from verl.trainer.dpo_trainer import DPOTrainer
from verl.trainer.rl_trainer import RLTrainer
from verl.trainer.sft_trainer import SFTTrainer
from verl.trainer.tool_demo import run_tool_demo


def build_trainer(config: RunConfig):
    kind = config.trainer.kind
    if kind == "rl":
        return RLTrainer(config)
    if kind == "dpo":
        return DPOTrainer(config)
    return SFTTrainer(config)


def run_training(config: RunConfig, *, demo: bool = False) -> int:
    try:
        recipe = config.trainer.demo or ("arithmetic" if demo else None)
        if recipe == "arithmetic":
            run_demo(config)
            return 0
        if recipe == "tool":
            run_tool_demo(config)
            return 0
        trainer = build_trainer(config)
        trainer.fit()
        if trainer.rank == 0:
            print(f"run directory: {trainer.run_dir}")
        return 0
    except TrainingInterrupted as exc:  # saved at a step boundary: say where, exit as the signal asks
        if int(os.environ.get("RANK", "0")) == 0:
            print(str(exc), file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        shutdown_distributed()
