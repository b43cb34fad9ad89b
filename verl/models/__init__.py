"""Model-side building blocks: load-time checks, the critic, reward-model scoring, tiny local models.

`load_hf_model` itself lives in `verl.utils.hf_loader` (the documented import path) and uses the checks here.
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
