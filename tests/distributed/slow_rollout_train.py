"""`verl train` whose rollout rank takes SLOW_S seconds over each batch after its first (run by
test_async_rollout.py): longer than devices.timeout_s, while the trainer, done with its update, waits to
deliver the new weights."""

from __future__ import annotations

import os
import sys
import time

from verl.config import load_config
from verl.distributed.process import shutdown_distributed
from verl.trainer.rl_trainer import RLTrainer


class SlowRollout(RLTrainer):
    def generate(self, batch):
        if self.async_rollout is not None and self.async_rollout.generates and self.async_rollout.drawn >= 1:
            time.sleep(float(os.environ.get("SLOW_S", "8")))
        return super().generate(batch)


if __name__ == "__main__":
    try:
        SlowRollout(load_config(sys.argv[1])).fit()
    finally:
        shutdown_distributed()
