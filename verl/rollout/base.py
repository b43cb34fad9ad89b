"""What every rollout engine takes and returns.

The trainer only talks to :class:`RolloutEngine`, so swapping our own sampler for vLLM is a config
change. The output layout is fixed here once (``n`` samples of prompt ``i`` are rows ``i*n .. i*n+n-1``,
responses right-padded, masks and logprobs aligned with the response tokens) so that rewards,
advantages and losses never have to guess how a batch was laid out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from verl.errors import ConfigError
from verl.utils.positions import position_ids_from_mask


@dataclass
class SamplingParams:
    """How to sample responses.

    ``temperature=0`` means greedy decoding. ``top_k`` of 0 or None and ``top_p`` of 1.0 switch those
    filters off. Generation of a row stops at the first token in ``eos_token_ids`` (an empty list
    never stops early) or after ``max_new_tokens``. ``pad_token_id`` fills responses after they stop;
    None means the first eos id, or 0 when there is none.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_new_tokens: int = 256
    n: int = 1
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.eos_token_ids, int):
            self.eos_token_ids = [self.eos_token_ids]
        elif self.eos_token_ids is None:
            self.eos_token_ids = []
        else:
            self.eos_token_ids = list(self.eos_token_ids)
        problems = []
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            problems.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}; use e.g. 1.0")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}; use 1.0 to switch it off")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            problems.append(f"top_k must be an int >= 0, got {self.top_k!r}; use 0 or None to switch it off")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.n, int) or self.n < 1:
            problems.append(f"n (samples per prompt) must be an int >= 1, got {self.n!r}")
        bad_eos = [e for e in self.eos_token_ids if not isinstance(e, int) or isinstance(e, bool) or e < 0]
        if bad_eos:
            problems.append(f"eos_token_ids must be non-negative ints, got {bad_eos!r} in "
                            f"{self.eos_token_ids!r}; take them from tokenizer.eos_token_id or "
                            "generation_config.eos_token_id")
        if self.pad_token_id is not None and (not isinstance(self.pad_token_id, int) or self.pad_token_id < 0):
            problems.append(f"pad_token_id must be a non-negative int or None, got {self.pad_token_id!r}")
        if problems:
            raise ConfigError("invalid SamplingParams:\n  - " + "\n  - ".join(problems))

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def resolved_pad_token_id(self) -> int:
        """The id that fills responses after they stop."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_token_ids[0] if self.eos_token_ids else 0


@dataclass
class RolloutOutput:
    """Sampled responses, laid out for the rest of the training step.

    Rows ``i*n .. i*n+n-1`` are the ``n`` samples of prompt ``i``. ``response_mask`` is 1 up to and
    including the eos token and 0 after it; ``logprobs`` is the log-probability of each sampled token
    under the distribution it was drawn from (after temperature/top-k/top-p), 0 where masked; for greedy
    decoding it is the model's untempered log-probability, since the greedy distribution is a point mass.
    """

    prompt_ids: torch.Tensor  # [B*n, P] left-padded
    prompt_mask: torch.Tensor  # [B*n, P]
    response_ids: torch.Tensor  # [B*n, R] right-padded with pad id
    response_mask: torch.Tensor  # [B*n, R]
    logprobs: torch.Tensor  # [B*n, R] float32
    finished: torch.Tensor  # [B*n] bool: stopped at an eos id before max_new_tokens ran out

    @property
    def sequences(self) -> torch.Tensor:
        """Prompt and response side by side, [B*n, P+R]."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """Mask of the full sequence: left padding of the prompt and right padding of the response are 0."""
        return torch.cat([self.prompt_mask.to(self.response_mask.dtype), self.response_mask], dim=1)

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions that count only real tokens, as the model saw them while sampling (pads get 0)."""
        return position_ids_from_mask(self.attention_mask)


class RolloutEngine(ABC):
    """A thing that turns left-padded prompts into sampled responses."""

    @abstractmethod
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None = None,
        images: Any = None,
    ) -> RolloutOutput:
        """Sample ``params.n`` responses for each row of ``input_ids`` ([B, P], left-padded); `images`: each row's
        (`verl.models.vision_inputs.RowImages` or None), for a vision-language model."""


__all__ = ["SamplingParams", "RolloutOutput", "RolloutEngine"]
