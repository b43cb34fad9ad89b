"""Batch arithmetic: a bad combination is a ConfigError with the numbers, raised before any model loads."""

from __future__ import annotations

import pytest
from rl_support import base_overrides

from verl.config import load_config
from verl.config.schema import OptimConfig
from verl.errors import ConfigError
from verl.trainer.forward.batch_math import plan_batches
from verl.trainer.rl_trainer import RLTrainer


@pytest.fixture
def no_model_load(monkeypatch):
    """Any attempt to load weights fails the test: the error must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the batch arithmetic was checked")

    monkeypatch.setattr("verl.models.hf_loader.load_hf_model", refuse)
    monkeypatch.setattr("verl.trainer.compose.components.load_policy_with_report", refuse)  # the one policy loader


def _trainer(tmp_path, *overrides):
    return RLTrainer(load_config(overrides=[*base_overrides(tmp_path), *overrides]))


def test_mini_batch_larger_than_batch(tmp_path, no_model_load):
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path, "data.train_batch_size=4", "actor.mini_batch_size=8")
    msg = str(err.value)
    assert "actor.mini_batch_size=8 is larger than data.train_batch_size=4; set it to at most 4" in msg
    assert "rollout.n=4" in msg and "nothing was loaded" in msg


def test_mini_batch_not_a_divisor(tmp_path, no_model_load):
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path, "data.train_batch_size=6", "actor.mini_batch_size=4")
    msg = str(err.value)
    assert "data.train_batch_size=6 is not a multiple of actor.mini_batch_size=4" in msg
    assert "Use a divisor of 6" in msg


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_need_several_samples(tmp_path, no_model_load, estimator):
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path, f"algorithm.adv_estimator={estimator}", "rollout.n=1")
    msg = str(err.value)
    assert f"algorithm.adv_estimator={estimator}" in msg and "rollout.n=1" in msg
    assert "every advantage would be 0" in msg and "rollout.n >= 2" in msg


def test_every_problem_is_listed_together_including_the_critic(tmp_path, no_model_load):
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path, "algorithm.adv_estimator=gae", "data.train_batch_size=4", "actor.mini_batch_size=5",
                 "critic.mini_batch_size=3")
    msg = str(err.value)
    assert "actor.mini_batch_size=5 is larger than data.train_batch_size=4" in msg
    assert "data.train_batch_size=4 is not a multiple of critic.mini_batch_size=3" in msg


def test_ppo_with_one_sample_per_prompt_is_fine(tmp_path, no_model_load):
    # GAE needs no group, so n=1 passes the arithmetic and reaches the model load
    with pytest.raises(AssertionError, match="a model was loaded"):
        _trainer(tmp_path, "algorithm.adv_estimator=gae", "rollout.n=1")


def test_plan_numbers_and_ranks():
    cfg = OptimConfig(mini_batch_size=4, micro_batch_size=3)
    plan = plan_batches(8, 4, cfg, 2)
    assert (plan.sequences_per_step, plan.sequences_per_rank, plan.mini_batch_sequences) == (32, 16, 8)
    assert (plan.num_mini_batches, plan.micro_batch_size, plan.grad_accum_steps) == (2, 3, 3)
    assert "2 optimizer step(s) of 8 sequences/rank" in plan.describe()
    whole = plan_batches(4, 2, OptimConfig(micro_batch_size=64), 1)
    assert (whole.num_mini_batches, whole.micro_batch_size, whole.grad_accum_steps) == (1, 8, 1)
    with pytest.raises(ConfigError) as err:
        plan_batches(4, 1, OptimConfig(mini_batch_size=1), 3)
    msg = str(err.value)
    assert "data.train_batch_size=4 prompts cannot be split evenly over 3 ranks" in msg
    assert "1 sequences cannot be split over 3 ranks" in msg
