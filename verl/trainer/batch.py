"""The one batch object that flows through an RL step.

Each stage fills in more fields (`generate` the responses, `compute_reward` the scores, ...) and never
reaches back; the update stages read mini-batches of it through `select`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from verl.utils.positions import position_ids_from_mask


@dataclass
class RolloutBatch:
    rows: list[dict[str, Any]]  # one per sequence: the prompt row, repeated n times
    group_ids: torch.Tensor  # [N] index of the prompt each sequence answers
    prompt_ids: torch.Tensor  # [N, P] left-padded
    prompt_mask: torch.Tensor  # [N, P]
    response_ids: torch.Tensor | None = None  # [N, R] right-padded
    response_mask: torch.Tensor | None = None  # [N, R] 1 on model-written tokens (the loss, KL, entropy)
    # [N, R] 1 on every real response token; multi-turn episodes also have observation tokens, which the
    # model reads (attention) but is not trained on (response_mask 0). None: the same as response_mask.
    response_attention_mask: torch.Tensor | None = None
    finished: torch.Tensor | None = None  # [N] stopped at eos (not truncated)
    rollout_logprobs: torch.Tensor | None = None  # [N, R] the sampler's log-prob of each response token
    responses: list[str] = field(default_factory=list)
    scores: torch.Tensor | None = None  # [N] sequence-level reward
    env_scores: torch.Tensor | None = None  # [N] multi-turn episodes: the reward the environment's step gave
    token_rewards: torch.Tensor | None = None  # [N, R]
    old_logprobs: torch.Tensor | None = None  # [N, R] actor before the update
    ref_logprobs: torch.Tensor | None = None  # [N, R]
    values: torch.Tensor | None = None  # [N, R]
    advantages: torch.Tensor | None = None  # [N, R]
    returns: torch.Tensor | None = None  # [N, R]
    reward_input_ids: torch.Tensor | None = None  # [N, L] prompt + response in the reward model's tokens
    reward_attention_mask: torch.Tensor | None = None  # [N, L]
    reward_model_scores: torch.Tensor | None = None  # [N] a reward model on ranks of its own
    metrics: dict[str, float] = field(default_factory=dict)  # what the stages measured (reward, KL, drift)

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_attention], dim=1)

    @property
    def response_attention(self) -> torch.Tensor:
        """What the model attends to after the prompt: every real token, observations of a multi-turn
        episode included (`response_mask` marks only the model-written ones, those in the loss)."""
        return self.response_attention_mask if self.response_attention_mask is not None else self.response_mask

    @property
    def position_ids(self) -> torch.Tensor:
        return position_ids_from_mask(self.attention_mask)

    @classmethod
    def from_fields(cls, fields: dict[str, torch.Tensor]) -> RolloutBatch:
        """The batch a ref/critic/reward rank builds from the tensors it was sent (it needs no prompt rows)."""
        n = next(iter(fields.values())).shape[0]
        blank = torch.zeros((n, 0), dtype=torch.long)
        base = {"prompt_ids": blank, "prompt_mask": blank, "group_ids": torch.arange(n)}
        return cls(rows=[{} for _ in range(n)], **(base | dict(fields)))

    def select(self, index: torch.Tensor) -> RolloutBatch:
        """A sub-batch (rows `index`) sharing nothing mutable with this one."""
        picked: dict[str, Any] = {}
        idx = index.tolist()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                picked[f.name] = value.index_select(0, index.to(value.device))
            elif isinstance(value, list) and value and len(value) == len(self):
                picked[f.name] = [value[i] for i in idx]
            else:
                picked[f.name] = value
        return RolloutBatch(**picked)

