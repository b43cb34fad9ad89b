"""`verl train` one of whose ranks (DYING_RANK: 1, the rollout rank, by default; 0, the trainer) is killed with
SIGKILL during step 2 (run by test_async_rollout.py): the other must stop with an error saying so, not wait for
ever."""

from __future__ import annotations

import os
import signal
import sys

from verl.config import load_config
from verl.distributed.process import shutdown_distributed
from verl.trainer.rl_trainer import RLTrainer


class RolloutRankDies(RLTrainer):
    def step(self):
        if self.rank == int(os.environ.get("DYING_RANK", "1")) and self.step_count == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step()


if __name__ == "__main__":
    try:
        RolloutRankDies(load_config(sys.argv[1])).fit()
    finally:
        shutdown_distributed()
