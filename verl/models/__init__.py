"""Model-side building blocks: load-time checks, the critic, reward-model scoring, tiny local models.

`load_hf_model` lives in `verl.models.hf_loader` (re-exported at the documented path `verl.utils.hf_loader`).
"""

from verl.models.checks import LoadReport, SpecialToken, check_model_and_tokenizer
from verl.models.critic import ValueModel
from verl.models.reward_model import RewardModelScorer
from verl.models.tiny import build_tiny_model, build_tiny_reward_model

__all__ = [
    "LoadReport",
    "SpecialToken",
    "check_model_and_tokenizer",
    "ValueModel",
    "RewardModelScorer",
    "build_tiny_model",
    "build_tiny_reward_model",
]
