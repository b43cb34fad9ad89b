"""reward.overlap: the RL trainer starts a response's reward calls as soon as its row finishes generating,
and the scores are the ones of scoring after generation, bit for bit."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import torch
from rl_support import rl_config

from verl.trainer.rl_trainer import RLTrainer


class SlowDigits:
    """A reward that takes a while (a sandbox or a remote call) and records when each call started."""

    __name__ = "slow_digits"

    def __init__(self) -> None:
        self.started: list[float] = []
        self.threads: set[str] = set()

    def __call__(self, prompt: Any, response: str, ground_truth: Any, **meta: Any) -> float:
        self.started.append(time.monotonic())
        self.threads.add(threading.current_thread().name)
        time.sleep(0.005)
        return sum(c.isdigit() for c in response) / max(len(response), 1) + len(response) / 1000


def trainer_with(tmp_path, overlap: bool, reward: SlowDigits) -> tuple[RLTrainer, list[float]]:
    """A tiny-model trainer whose rows end at different steps (one token in 8 ends a response) and whose
    decode steps take 2 ms each, so that the early rows finish well before the batch; the list gets the
    time each rollout ended."""
    torch.set_num_threads(1)
    config = rl_config(tmp_path / f"overlap-{overlap}", "rollout.max_new_tokens=24", f"reward.overlap={overlap}",
                       "trainer.total_steps=2", "trainer.seed=7")
    trainer = RLTrainer(config, reward_functions=[reward])
    vocab = len(trainer.tokenizer)
    trainer.sampling = dataclasses.replace(trainer.sampling, eos_token_ids=[*trainer.sampling.eos_token_ids,
                                                                            *range(0, vocab - 3, 8)])
    trainer.engine.between_tokens = lambda step: time.sleep(0.002) or False
    ended: list[float] = []
    generate = trainer.engine.generate

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        out = generate(*args, **kwargs)
        ended.append(time.monotonic())
        return out

    trainer.engine.generate = timed_generate
    return trainer, ended


def test_reward_calls_start_while_generating_and_score_as_after_it(tmp_path):
    results = {}
    for overlap in (True, False):
        reward = SlowDigits()
        trainer, ended = trainer_with(tmp_path, overlap, reward)
        assert trainer.reward_overlap.enabled is overlap
        batch = trainer.compute_reward(trainer.generate(trainer.get_batch()))
        lengths = batch.response_mask.sum(1)
        assert int(lengths.max()) - int(lengths.min()) >= 8  # rows finish at different steps
        early = sum(t < ended[0] for t in reward.started)
        if overlap:
            assert early >= 1, "no reward call started before generation ended"
            assert all(name.startswith("verl-reward") for name in reward.threads)
        else:
            assert early == 0
        results[overlap] = batch
    on, off = results[True], results[False]
    assert torch.equal(on.response_ids, off.response_ids)
    assert torch.equal(on.scores, off.scores) and torch.equal(on.token_rewards, off.token_rewards)
    assert on.metrics == off.metrics


def test_a_batch_the_scoring_was_not_started_for_is_scored_after_generation(tmp_path):
    reward = SlowDigits()
    trainer, _ = trainer_with(tmp_path, True, reward)
    first = trainer.generate(trainer.get_batch())
    second = trainer.generate(trainer.get_batch())  # the pending scoring is now the second batch's
    scored_first = trainer.compute_reward(first)  # no match: plain scoring
    want = trainer.env.compute_reward(first.rows, first.responses)
    assert torch.equal(scored_first.scores, want.scores.float())
    assert trainer.reward_overlap.finish(second) is None  # taken (and dropped) by the first batch's call
    metrics = trainer.step()  # the whole step with overlap
    assert metrics["reward/timeouts"] == 0.0 and "timing/reward" in metrics
