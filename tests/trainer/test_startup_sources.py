"""Start-up checks of where a run reads and writes: model sources (`tiny`, hub ids while offline), the
run folder and the logging backends; each fails in seconds with what, where and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from rl_support import rl_config  # pytest puts this folder on sys.path

from verl.trainer.rl_trainer import RLTrainer


def test_critic_and_reward_model_accept_tiny(tmp_path):
    """`critic.path=tiny` / `reward.model_path=tiny` build locally as `model.path=tiny` does (the reward model
    with a one-label score head), instead of a hub look-up for a repository called `tiny`."""
    cfg = rl_config(tmp_path / "run", "algorithm.adv_estimator=gae", "critic.path=tiny",
                    "reward.model_path=tiny", "reward.model_weight=0.5", reward={"name": "numeric_match"})
    trainer = RLTrainer(cfg)
    assert type(trainer.critic).__name__ == "ValueModel"
    rm = trainer.env.reward_manager
    assert rm.names == ["numeric_match", "reward_model"]
    scorer = next(ld.fn for ld in rm._loaded if ld.label == "reward_model").scorer
    assert scorer.model.config.num_labels == 1 and Path(scorer.source).is_dir()
    assert scorer.score_texts(["1+1=2"]).shape == (1,)
