"""Worker for test_rl_filter_groups_dist.py: DAPO dynamic sampling (`algorithm.filter_groups`) on 2 gloo
ranks. Rank 0 scores half its prompts with equal rewards (it needs more draws), rank 1 scores every group
with varied rewards (it needs none), so the ranks disagree on whether to draw again."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from _dist_workers import setup

from verl.config import load_config
from verl.trainer.batch import varied_groups
from verl.trainer.rl_trainer import RLTrainer

TRAIN_BATCH, N = 8, 2


def rank_reward(prompt, response, ground_truth, **meta):
    """Rank 0: equal rewards for prompts whose digits sum to an even number; otherwise (and on rank 1) a
    reward that depends on the response text, so a group's samples differ."""
    if os.environ.get("RANK") == "0" and sum(int(c) for c in str(prompt) if c.isdigit()) % 2 == 0:
        return 1.0
    return float(sum(map(ord, response)) % 7)


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    setup(rank, world, port)
    config = load_config(overrides=[
        "model.path=tiny", "model.dtype=float32", "trainer.device=cpu", "trainer.cpu_threads=1",
        "env.name=arithmetic", "env.kwargs.max_operand=9", "env.kwargs.num_val=4",
        f"data.train_batch_size={TRAIN_BATCH}", f"rollout.n={N}", "rollout.max_new_tokens=6",
        "algorithm.filter_groups=true", "algorithm.max_resample_rounds=8", "logging.backends=[]",
        f"trainer.run_dir={Path(out_dir) / 'run'}", "trainer.val_before_train=false", "trainer.resume=never",
        "trainer.total_steps=1"])
    config.reward.functions = [{"name": f"{Path(__file__).resolve()}:rank_reward"}]
    trainer = RLTrainer(config)
    first = trainer.compute_reward(trainer.generate(trainer.get_batch()))
    metrics: dict[str, float] = {}
    out = trainer.filter_groups(first, metrics)
    scores = [rank_reward(row["prompt"], text, None) for row, text in zip(out.rows, out.responses, strict=True)]
    torch.save({"first_varied": varied_groups(first), "first_ids": first.group_ids,
                "group_ids": out.group_ids, "varied": varied_groups(out), "scores": out.scores,
                "recomputed": torch.tensor(scores), "metrics": metrics, "dp": (trainer.dp_rank, trainer.dp_size)},
               Path(out_dir) / f"rank{rank}.pt")
