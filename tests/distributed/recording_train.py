"""`verl train` whose actor ranks record every batch they score (run by test_async_rollout.py): the responses'
text, token ids and the environment's scores, to `<run_dir>.batches.jsonl`, so that a test can compare the
samples of two runs, not only their metrics."""

from __future__ import annotations

import json
import sys

from verl.config import load_config
from verl.distributed.process import shutdown_distributed
from verl.trainer.rl_trainer import RLTrainer


class Recording(RLTrainer):
    def compute_reward(self, batch):
        batch = super().compute_reward(batch)
        record = {"step": self.step_count + 1, "responses": batch.responses,
                  "response_ids": batch.response_ids.tolist(), "response_mask": batch.response_mask.tolist(),
                  "rollout_logprobs": batch.rollout_logprobs.tolist(), "scores": batch.scores.tolist()}
        with open(f"{self.run_dir}.batches.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        return batch


if __name__ == "__main__":
    try:
        Recording(load_config(sys.argv[1])).fit()
    finally:
        shutdown_distributed()
