"""`verl train` whose rollout rank holds batch 2 after its second token until the actor has posted the weights
of its first update (run by test_async_rollout.py), so that the rest of batch 2 is a partial rollout every time,
however fast either side is."""

from __future__ import annotations

import sys
import time

from verl.config import load_config
from verl.distributed.process import shutdown_distributed
from verl.trainer.rl_trainer import RLTrainer


class HeldRollout(RLTrainer):
    def __init__(self, config):
        super().__init__(config)
        rollout = self.async_rollout
        take = rollout._take_delivery

        def held(step, switches):
            if rollout.generates and rollout.drawn == 1 and step == 1:  # batch 2, its second token written
                deadline = time.monotonic() + 60
                while not rollout.groups.guard.signalled("async/weights/1") and time.monotonic() < deadline:
                    time.sleep(0.01)
                rollout._next_poll = 0.0  # ask the store now, whenever it was last asked
            return take(step, switches)

        rollout._take_delivery = held


if __name__ == "__main__":
    try:
        HeldRollout(load_config(sys.argv[1])).fit()
    finally:
        shutdown_distributed()
