"""A reward model (`reward.model_path`) as one more batched reward function.

Going through the reward manager means a reward model combines with rule-based rewards by weight,
gets the same error handling and shows up in the metrics as `reward/reward_model/score`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from verl.models.reward_model import RewardModelScorer


class RewardModelFunction:
    """Scores prompt + response with a sequence-classification model, in the model's own chat format."""

    __name__ = "reward_model"

    def __init__(self, scorer: RewardModelScorer, weight: float) -> None:
        self.scorer = scorer
        self.reward_spec = {"weight": weight, "batched": True}

    def __call__(self, prompts: Sequence[Any], responses: Sequence[str], ground_truths: Sequence[Any],
                 metadatas: Sequence[Mapping[str, Any]]) -> list[float]:
        texts = [reward_text(self.scorer.tokenizer, p, r) for p, r in zip(prompts, responses, strict=True)]
        return self.scorer.score_texts(texts).tolist()


def reward_text(tokenizer: Any, prompt: Any, response: str) -> str:
    """What the reward model reads: prompt + response, in the reward model's own chat format for messages."""
    if isinstance(prompt, list):
        messages = [*prompt, {"role": "assistant", "content": response}]
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return f"{prompt}{response}"


def reward_model_inputs(tokenizer: Any, prompts: Sequence[Any], responses: Sequence[str]) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """(ids, attention mask) of prompt + response in the reward model's own tokens, right-padded."""
    texts = [reward_text(tokenizer, p, r) for p, r in zip(prompts, responses, strict=True)]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]
