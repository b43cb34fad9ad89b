"""Split role placements, the parts that need no processes: batch plans per role, and the offline
trainers' refusal (they run every role on every rank)."""

import pytest

from verl.config import load_config
from verl.errors import ConfigError, DeviceMappingError
from verl.trainer.forward.batch_math import plan_rl
from verl.trainer.offline.dpo_trainer import DPOTrainer


def _ppo(*overrides):
    return load_config(overrides=["model.path=tiny", "trainer.device=cpu", "algorithm.adv_estimator=gae",
                                  "data.train_batch_size=4", "rollout.n=2", *overrides])


def test_critic_plan_uses_the_critic_rank_count():
    plans = plan_rl(_ppo(), 2, 1)  # actor on 2 ranks, critic on 1
    assert (plans["actor"].dp_size, plans["actor"].sequences_per_rank) == (2, 4)
    assert (plans["critic"].dp_size, plans["critic"].sequences_per_rank) == (1, 8)
    assert plan_rl(_ppo(), 2)["critic"].dp_size == 2  # colocated: the actor's ranks


def test_critic_rank_count_that_does_not_divide_the_batch_is_reported():
    with pytest.raises(ConfigError) as err:
        plan_rl(_ppo(), 2, 3)
    assert "critic.mini_batch_size" in str(err.value) and "3 ranks" in str(err.value)


def test_offline_trainers_refuse_a_split_placement_before_loading(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    config = load_config(overrides=["trainer.kind=dpo", "model.path=tiny", "trainer.device=cpu",
                                    "data.train_batch_size=2", "devices.actor=[0,1]", "devices.ref=[0]",
                                    f"trainer.run_dir={tmp_path}"])
    with pytest.raises(DeviceMappingError) as err:
        DPOTrainer(config)
    message = str(err.value)
    assert "the dpo trainer runs every role on every rank" in message and "Fix: remove devices." in message
    assert "ref" in message and "0" in message  # the mapping table
