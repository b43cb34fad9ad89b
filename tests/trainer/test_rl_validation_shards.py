"""Validation on several actor ranks: each answers its own share of the held-out rows, and the reduced
result equals one rank answering them all (simulated here in one process: the reduction is a sum)."""

from __future__ import annotations

import pytest
import torch
from rl_support import rl_config  # pytest puts this folder on sys.path

from verl import RLTrainer


@pytest.fixture
def trainer(tmp_path):
    torch.manual_seed(0)
    config = rl_config(tmp_path, "env.kwargs.num_val=7", "data.val_batch_size=2", "trainer.log_samples=2",
                       reward=None)
    return RLTrainer(config)


def test_each_rank_answers_its_share_and_the_sums_equal_one_rank(trainer, monkeypatch):
    rows = trainer.env.val_rows()
    whole_samples: list[dict] = []
    whole = trainer.evaluate(rows, samples=whole_samples)
    assert set(whole) == {"val/score", "val/accuracy"}

    answered: list[list[str]] = []
    real_generate = trainer.engine.generate

    def counting_generate(ids, mask, params, generator=None):
        answered[-1].append(ids.shape[0])
        return real_generate(ids, mask, params, generator=generator)

    monkeypatch.setattr(trainer.engine, "generate", counting_generate)
    reduced = []
    monkeypatch.setattr(trainer.placement, "all_reduce_sum", lambda t, role="home": reduced.append(t) or t)
    trainer.dp_size = 3  # 7 rows: shares of 3, 3 and 1
    per_rank = []
    for rank in range(3):
        trainer.dp_rank = rank
        answered.append([])
        samples: list[dict] = []
        per_rank.append((trainer.evaluate(rows, samples=samples), samples))
    # every rank runs the same number of generations (2 chunks of <= 2 rows); the last rank's second chunk
    # answers one padding row that does not count
    assert answered == [[2, 1], [2, 1], [1, 1]]
    assert sum(float(t[0]) for t in reduced) == pytest.approx(whole["val/score"] * len(rows), abs=1e-9)
    assert all(float(t[1]) == 0 for t in reduced)  # 0/1 scores: accuracy is reported
    # the samples of rank 0 are the first rows, as one rank logs them
    assert per_rank[0][1] == whole_samples and len(whole_samples) == 2
    assert [s["prompt"] for s in per_rank[2][1]] == [rows[6]["prompt"]]
