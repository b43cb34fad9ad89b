"""Train with an RLTrainer subclass that replaces one stage (run under torchrun by test_rl_split.py).

`compute_values` runs on the critic's ranks; each rank that runs it writes what it saw, so the test
can tell that the override ran there (and only there) under a split placement.
"""

from __future__ import annotations

import json
import sys

from verl.config import load_config
from verl.distributed.process import shutdown_distributed
from verl.trainer.rl_trainer import RLTrainer


class RecordingValues(RLTrainer):
    def compute_values(self, batch):
        batch = super().compute_values(batch)
        record = self.run_dir.parent / f"values_rank{self.rank}_step{self.step_count}.json"
        record.write_text(json.dumps({"rows": len(batch), "holds_actor": self.model is not None}))
        return batch


if __name__ == "__main__":
    try:
        RecordingValues(load_config(sys.argv[1])).fit()
    finally:
        shutdown_distributed()  # as `verl train` does: no gloo thread left alive at exit
