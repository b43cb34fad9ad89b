"""A reward model (`reward.model_path`) scores rollouts next to rule-based rewards."""

import pytest
from rl_support import digit_reward, rl_config  # pytest puts this folder on sys.path

from verl.errors import ModelError, VerlError
from verl.models.tiny import build_tiny_reward_model
from verl.rewards import RewardManager
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


def test_a_reward_model_folder_without_a_score_head_is_refused_at_start_up(tmp_path):
    from verl.models.tiny import build_tiny_model

    causal = build_tiny_model()  # a causal LM: transformers would give it a random score head
    with pytest.raises(VerlError, match=r"reward.model_path=.* has no trained score head: its weights lack "
                                        r"score.weight \(the folder holds a Qwen2ForCausalLM\)"):
        RLTrainer(rl_config(tmp_path, f"reward.model_path={causal}"))


def test_val_functions_score_validation_with_the_training_reward_kept_beside(tmp_path):
    """reward.val_functions=[numeric_match]: validation's accuracy is numeric_match's while training scores with
    digit_reward; each sample keeps its training reward, and val/training_reward is their mean."""
    cfg = rl_config(tmp_path, "reward.val_functions=[numeric_match]", "trainer.log_samples=16")
    trainer = RLTrainer(cfg)
    assert trainer.env.reward_manager.names == ["digit_reward"]
    metrics = trainer.validate()
    samples = trainer.validation_samples
    assert len(samples) == 16 == len(trainer.env.val_rows())
    truth = RewardManager([{"name": "numeric_match"}]).score([s["prompt"] for s in samples],
                                                             [s["response"] for s in samples],
                                                             [s["ground_truth"] for s in samples])
    assert [s["score"] for s in samples] == truth.scores.tolist()
    digits = [digit_reward(s["prompt"], s["response"], s["ground_truth"]) for s in samples]
    assert [s["reward_extras"]["training_reward"] for s in samples] == pytest.approx(digits, abs=1e-6)
    assert metrics["val/accuracy"] == pytest.approx(sum(truth.scores.tolist()) / 16)
    assert metrics["val/training_reward"] == pytest.approx(sum(digits) / 16, abs=1e-6)
    with pytest.raises(VerlError, match="reward.val_functions"):
        RLTrainer(rl_config(tmp_path, "reward.val_functions=[no_such_reward]"))
