"""The on-policy guard: the sampler's log-probs are compared with the trainer's every step; an engine that
keeps its own (stale) weights is stopped with an error naming it, our sampler passes."""

from __future__ import annotations

import copy

import pytest
from rl_support import read_metrics, rl_config

from verl.errors import RolloutError
from verl.rollout import HFKVCacheEngine
from verl.trainer.rl_trainer import RLTrainer


@pytest.mark.parametrize("extra", [["actor.kl_loss_coef=0.01"], []], ids=["old-logprobs", "sampled-subset"])
def test_our_sampler_stays_on_policy(tmp_path, extra):
    trainer = RLTrainer(rl_config(tmp_path, "trainer.total_steps=3", *extra))
    assert trainer.needs_old_logprobs == bool(extra)
    trainer.fit()
    rows = read_metrics(tmp_path)
    for row in rows:
        assert 0.0 <= row["rollout/logprob_diff_mean"] <= row["rollout/logprob_diff_max"] < 1e-4


def test_a_stale_engine_is_caught(tmp_path):
    config = rl_config(tmp_path, "trainer.total_steps=8", "actor.lr=0.05", "actor.grad_clip=null")
    trainer = RLTrainer(config)
    trainer.engine = HFKVCacheEngine(copy.deepcopy(trainer.model))  # samples from the initial weights forever
    with pytest.raises(RolloutError) as err:
        trainer.fit()
    msg = str(err.value)
    assert "'hf' rollout engine" in msg and "rollout.max_logprob_drift=0.1" in msg and "Fix:" in msg
    assert 1 <= trainer.step_count < 8  # caught within a few steps, not at the end
    assert read_metrics(tmp_path)[0]["rollout/logprob_diff_mean"] < 1e-4  # step 1: the weights still agree


def test_drift_is_logged_not_enforced_with_top_k(tmp_path):
    config = rl_config(tmp_path, "trainer.total_steps=2", "rollout.top_k=5", "rollout.max_logprob_drift=1e-9")
    RLTrainer(config).fit()  # top-k renormalises the sampler's distribution: no false alarm
    assert all(row["rollout/logprob_diff_mean"] > 0 for row in read_metrics(tmp_path))
