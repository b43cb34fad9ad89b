"""reward.overlap: the RL trainer starts a response's reward calls as soon as its row finishes generating,
and the scores are the ones of scoring after generation, bit for bit."""

from __future__ import annotations

import dataclasses
import os
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


def trainer_with(tmp_path, overlap: bool, reward: SlowDigits | dict[str, Any], *overrides: str,
                 ) -> tuple[RLTrainer, list[float]]:
    """A tiny-model trainer whose rows end at different steps (one token in 8 ends a response) and whose
    decode steps take 2 ms each, so that the early rows finish well before the batch; the list gets the
    time each rollout ended. `reward`: a callable, or a spec (a worker process loads it by its name)."""
    torch.set_num_threads(1)
    spec = reward if isinstance(reward, dict) else None
    config = rl_config(tmp_path / f"overlap-{overlap}-{len(overrides)}", "rollout.max_new_tokens=24",
                       f"reward.overlap={overlap}", "trainer.total_steps=2", "trainer.seed=7", *overrides, reward=spec)
    trainer = RLTrainer(config, reward_functions=None if spec else [reward])
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
    assert on.responses == off.responses  # the texts decoded as rows finished are the batch's


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


LOGGED_REWARD = """
import os, time

def slow_digits(prompt, response, ground_truth, log_dir, **meta):
    started = time.monotonic()  # the system's monotonic clock: comparable with the trainer's
    time.sleep(0.005)
    with open(os.path.join(log_dir, f"{os.getpid()}-{started!r}"), "w"):
        pass
    return sum(c.isdigit() for c in response) / max(len(response), 1) + len(response) / 1000
"""


def test_reward_calls_in_worker_processes_start_while_generating_and_score_the_same(tmp_path):
    (tmp_path / "logged_reward.py").write_text(LOGGED_REWARD)
    results = {}
    for executor in ("process", "thread"):
        logs = tmp_path / f"calls-{executor}"
        logs.mkdir()
        spec = {"name": f"{tmp_path / 'logged_reward.py'}:slow_digits", "kwargs": {"log_dir": str(logs)}}
        trainer, ended = trainer_with(tmp_path / executor, True, spec, f"reward.executor={executor}")
        assert (trainer.env.reward_manager.sample_pool is not None) is (executor == "process")
        metrics = trainer.step()  # a whole step on the pool (and the workers are up)
        assert metrics["reward/timeouts"] == 0.0
        for log in os.listdir(logs):
            os.remove(logs / log)
        batch = trainer.compute_reward(trainer.generate(trainer.get_batch()))
        calls = [name.split("-", 1) for name in os.listdir(logs)]
        assert len(calls) == len(batch)
        if executor == "process":
            assert {int(pid) for pid, _ in calls}.isdisjoint({os.getpid()})
            assert sum(float(started) < ended[-1] for _, started in calls) >= 1, "no call started while generating"
        results[executor] = batch
    on, off = results["process"], results["thread"]
    assert torch.equal(on.response_ids, off.response_ids)
    assert torch.equal(on.scores, off.scores) and on.metrics == off.metrics


def stage_order(trainer: RLTrainer) -> list[str]:
    """The names of the step's stages, in the order `trainer` runs them from now on."""
    order: list[str] = []
    stages = {"compute_reward": "reward", "compute_log_probs": "old_logprobs", "compute_ref_log_probs": "ref",
              "compute_advantages": "advantages"}
    for method, name in stages.items():
        stage = getattr(trainer, method)
        setattr(trainer, method, lambda batch, stage=stage, name=name: order.append(name) or stage(batch))
    return order


def test_rewards_are_waited_for_behind_the_forward_passes_unless_resampling_needs_them_first(tmp_path):
    torch.set_num_threads(1)
    trainer = RLTrainer(rl_config(tmp_path / "kl", "actor.kl_loss_coef=0.01", "trainer.total_steps=1"))
    order = stage_order(trainer)
    trainer.step()
    assert order == ["old_logprobs", "ref", "reward", "advantages"]  # the calls finish behind both passes
    trainer = RLTrainer(rl_config(tmp_path / "dapo", "actor.kl_loss_coef=0.01", "algorithm.filter_groups=true",
                                  "algorithm.max_resample_rounds=0", "trainer.total_steps=1"))
    order = stage_order(trainer)
    trainer.step()
    assert order[:3] == ["reward", "old_logprobs", "ref"]  # resampling decides the batch first
