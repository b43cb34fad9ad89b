"""`verl train` in which only rank 1 receives SIGTERM, during step 1 (run under torchrun by
test_preemption.py): as when a scheduler's signal reaches the ranks at different times."""

from __future__ import annotations

import os
import signal
import sys

from verl.checkpoint import TrainingInterrupted
from verl.config import load_config
from verl.distributed.process import shutdown_distributed
from verl.trainer.rl_trainer import RLTrainer


class SignalledOnRankOne(RLTrainer):
    def step(self):
        if self.rank == 1 and self.step_count == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().step()


if __name__ == "__main__":
    try:
        SignalledOnRankOne(load_config(sys.argv[1])).fit()
    except TrainingInterrupted as exc:  # as `verl train` does: say where it stopped, exit 128 + signal
        print(f"rank {os.environ.get('RANK')}: {exc}", flush=True)
        sys.exit(exc.exit_code)
    finally:
        shutdown_distributed()
