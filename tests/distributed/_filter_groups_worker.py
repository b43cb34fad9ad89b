"""Worker for test_rl_filter_groups_dist.py: DAPO dynamic sampling (`algorithm.filter_groups`) on 2 gloo
ranks. Rank 0 scores half its prompts (then, in a second phase, all of them) with equal rewards, rank 1 scores
every group with varied rewards, so rank 0 is short where rank 1 has varied groups to spare."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from _dist_workers import setup

from verl.batch import varied_groups
from verl.config import load_config
from verl.trainer.rl_trainer import RLTrainer

TRAIN_BATCH, N = 8, 2


def score_for(rank: int, prompt, response) -> float:
    """The reward of a response scored on `rank`: rank 0 gives equal rewards to prompts whose digits sum to
    an even number (to every prompt in the all-equal phase); otherwise a reward that depends on the response
    text, so a group's samples differ."""
    even = sum(int(c) for c in str(prompt) if c.isdigit()) % 2 == 0
    if rank == 0 and (even or os.environ.get("FG_PHASE") == "all_equal"):
        return 1.0
    return float(sum(map(ord, response)) % 7)


def rank_reward(prompt, response, ground_truth, **meta):
    return score_for(int(os.environ["RANK"]), prompt, response)


def _result(trainer, first, out, metrics) -> dict:
    per_rank = TRAIN_BATCH // 2
    origin = [int(g) % TRAIN_BATCH // per_rank for g in out.group_ids]  # the rank that drew (and scored) it
    scores = [score_for(o, row["prompt"], text) for o, row, text in zip(origin, out.rows, out.responses, strict=True)]
    return {"first_varied": varied_groups(first), "first_ids": first.group_ids, "group_ids": out.group_ids,
            "varied": varied_groups(out), "scores": out.scores, "recomputed": torch.tensor(scores),
            "metrics": metrics, "dp": (trainer.dp_rank, trainer.dp_size)}


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
    results = {}
    for phase, rounds in (("half_equal", 8), ("all_equal", 4)):
        # all_equal: rank 0 draws no varied group at all; rank 1 ends with spare ones
        os.environ["FG_PHASE"] = phase
        trainer.config.algorithm.max_resample_rounds = rounds
        first = trainer.compute_reward(trainer.generate(trainer.get_batch()))
        metrics: dict[str, float] = {}
        out = trainer.filter_groups(first, metrics)
        results[phase] = _result(trainer, first, out, metrics)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
