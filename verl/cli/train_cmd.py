"""`verl train`: the trainer for `trainer.kind`, or a demo: the built-in one when there is no config, the one
`trainer.demo` names otherwise."""

from __future__ import annotations

import os
import sys

from verl.checkpoint import TrainingInterrupted
from verl.config.schema import RunConfig
from verl.demos.agent import run_agent_demo
from verl.demos.arithmetic import run_demo
from verl.demos.rlhf import run_rlhf_demo
from verl.demos.tool import run_tool_demo
from verl.demos.vision import run_vision_demo
from verl.distributed.process import shutdown_distributed
from verl.trainer.entry import build_trainer


def run_training(config: RunConfig, *, demo: bool = False) -> int:
    try:
        recipe = config.trainer.demo or ("arithmetic" if demo else None)
        if recipe == "arithmetic":
            run_demo(config)
            return 0
        if recipe == "rlhf":
            run_rlhf_demo(config)
            return 0
        if recipe == "vision":
            run_vision_demo(config)
            return 0
        if recipe in ("tool", "agent"):
            (run_tool_demo if recipe == "tool" else run_agent_demo)(config)
            return 0
        trainer = build_trainer(config)
        trainer.fit()
        if trainer.rank == 0 and "console" not in config.logging.backends:  # else the run's summary named it
            print(f"run directory: {trainer.run_dir}")
        return 0
    except TrainingInterrupted as exc:  # saved at a step boundary: say where, exit as the signal asks
        if int(os.environ.get("RANK", "0")) == 0:
            print(str(exc), file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        shutdown_distributed()


__all__ = ["run_training"]
