"""A reward model (`reward.model_path`) as one more batched reward function.

Going through the reward manager means a reward model combines with rule-based rewards by weight,
gets the same error handling and shows up in the metrics as `reward/reward_model/score`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl.algorithms import place_score_on_last_token
from verl.batch import REWARD_TOKENS, RolloutBatch, fields_of, padding, read_by, written_by
from verl.data.chat import reward_text  # what the reward model reads: the same text it was trained on
from verl.distributed.placement import Placement
from verl.models.reward_model import RewardModelScorer
from verl.utils.tokenizer_protocol import Tokenizer


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


def reward_model_inputs(tokenizer: Tokenizer, prompts: Sequence[Any],
                        responses: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of prompt + response in the reward model's own tokens, right-padded."""
    texts = [reward_text(tokenizer, p, r) for p, r in zip(prompts, responses, strict=True)]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


@dataclass
class RemoteRewardModel:
    """A reward model on ranks of its own (devices.reward apart from the actor's): the actor ranks tokenise
    prompt + response in its tokens, its ranks score them, the actor ranks add `weight` x the scores, as the
    reward function would colocated. `scorer` is None off the reward ranks."""

    tokenizer: Tokenizer
    scorer: RewardModelScorer | None
    weight: float

    def score(self, batch: RolloutBatch | None, placement: Placement) -> RolloutBatch | None:
        """The three stages on their ranks (`placement.run` moves the fields between them)."""
        pads = padding(fields_of(REWARD_TOKENS), reward_pad_token_id=self.tokenizer.pad_token_id)
        batch = placement.align(placement.run("actor", self.inputs, batch), pads)
        batch = placement.run("reward", self.scores, batch, send=read_by("reward"), back=written_by("reward"))
        return placement.run("actor", self.add_scores, batch)

    def inputs(self, batch: RolloutBatch) -> RolloutBatch:
        batch.reward_input_ids, batch.reward_attention_mask = reward_model_inputs(
            self.tokenizer, [row["prompt"] for row in batch.rows], batch.responses)
        return batch

    def scores(self, batch: RolloutBatch) -> RolloutBatch:
        batch.reward_model_scores = self.scorer.score_ids(batch.reward_input_ids, batch.reward_attention_mask)
        return batch

    def add_scores(self, batch: RolloutBatch) -> RolloutBatch:
        scores = batch.reward_model_scores.to(batch.scores.device, torch.float32)
        batch.scores = batch.scores + self.weight * scores
        batch.token_rewards = place_score_on_last_token(batch.scores, batch.response_mask.float())
        batch.metrics["reward/reward_model/score"] = float(scores.mean())
        return batch
