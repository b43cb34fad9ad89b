"""A reward model (`reward.model_path`) scores rollouts next to rule-based rewards."""

import pytest
from rl_support import rl_config  # pytest puts this folder on sys.path

from verl.errors import ModelError
from verl.models.tiny import build_tiny_reward_model
from verl.trainer.rl_trainer import RLTrainer


@pytest.fixture(scope="module")
def reward_model_path():
    return build_tiny_reward_model()


def test_reward_model_scores_are_added_by_weight(tmp_path, reward_model_path):
    cfg = rl_config(tmp_path, "reward.model_path=" + reward_model_path, "reward.model_weight=0.5",
                    reward={"name": "numeric_match"})
    trainer = RLTrainer(cfg)
    batch = trainer.compute_reward(trainer.generate(trainer.get_batch()))
    rm = trainer.env.reward_manager
    assert rm.names == ["numeric_match", "reward_model"]
    scorer = next(ld.fn for ld in rm._loaded if ld.label == "reward_model").scorer
    texts = [row["prompt"] + response for row, response in zip(batch.rows, batch.responses, strict=True)]
    expected = scorer.score_texts(texts)
    numeric = rm.score([r["prompt"] for r in batch.rows], batch.responses,
                       [r["ground_truth"] for r in batch.rows]).per_function["numeric_match"]
    assert batch.scores.cpu().tolist() == pytest.approx((numeric + 0.5 * expected).tolist(), abs=1e-5)
    assert "reward/reward_model/score" in batch.metrics


def test_missing_reward_model_is_a_model_error(tmp_path):
    cfg = rl_config(tmp_path, f"reward.model_path={tmp_path / 'nope'}")
    with pytest.raises(ModelError, match="reward model"):
        RLTrainer(cfg)
