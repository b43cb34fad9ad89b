"""The RL core math: pure tensor functions with no I/O, importing only torch.

Every formula of the training step lives here exactly once; the trainers call these functions and do
not re-derive them.
"""

from .advantages import (
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_pp_returns,
    compute_rloo_advantages,
    overlong_penalty,
    place_score_on_last_token,
)
from .core import (
    AGG_MODES,
    aggregate_loss,
    explained_variance,
    masked_mean,
    masked_moments,
    masked_var,
    masked_whiten,
    whiten_from_moments,
)
from .dpo import DPO_LOSS_TYPES, dpo_loss
from .entropy import AdaptiveEntropyController, masked_quantiles, top_entropy_mask
from .estimators import ESTIMATOR_NAMES, ESTIMATORS, AdvantageEstimator, EstimatorParams, get_estimator
from .head_logprobs import head_token_logprobs
from .kl import K3_CLAMP, KL_KINDS, AdaptiveKLController, FixedKLController, kl_penalty, sequence_kl_sums
from .logits import entropy_from_logits, token_logprobs, token_logprobs_and_entropy
from .losses import ppo_policy_loss, value_loss
from .reward_model import bradley_terry_loss

__all__ = [
    "AGG_MODES",
    "ESTIMATORS",
    "ESTIMATOR_NAMES",
    "AdvantageEstimator",
    "EstimatorParams",
    "get_estimator",
    "head_token_logprobs",
    "DPO_LOSS_TYPES",
    "K3_CLAMP",
    "KL_KINDS",
    "AdaptiveEntropyController",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate_loss",
    "bradley_terry_loss",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_reinforce_pp_returns",
    "compute_rloo_advantages",
    "dpo_loss",
    "entropy_from_logits",
    "explained_variance",
    "kl_penalty",
    "masked_mean",
    "masked_moments",
    "masked_quantiles",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "place_score_on_last_token",
    "ppo_policy_loss",
    "sequence_kl_sums",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "top_entropy_mask",
    "value_loss",
    "whiten_from_moments",
]
