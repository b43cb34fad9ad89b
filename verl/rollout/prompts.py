"""Prompt rows to token ids and response ids back to text, as every RL stage and the episodes see them.

One object (the tokenizer with `data.*`'s prompt rules) instead of a trainer reference, so the multi-turn
episodes and the demos receive exactly what they use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl.config.schema import DataConfig
from verl.data import PromptDataset
from verl.utils.tokenizer_protocol import Tokenizer


@dataclass(frozen=True)
class PromptCodec:
    tokenizer: Tokenizer
    data: DataConfig

    def encode(self, rows: Sequence[Mapping[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and mask, through the data layer's `PromptDataset` (chat template, length
        limit). Rows are never dropped here, since each one owns n responses; `data.truncation=drop` already
        filtered over-long rows when the files were read, so a long prompt left now is an error."""
        d = self.data
        truncation = "truncate_left" if d.truncation == "truncate_left" else "error"
        data = PromptDataset([dict(r) for r in rows], self.tokenizer, d.max_prompt_length, truncation,
                             d.apply_chat_template)
        batch = data.collate([data[i] for i in range(len(data))])
        return batch["input_ids"], batch["attention_mask"]

    def decode(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        lengths = response_mask.sum(-1).tolist()
        return [self.tokenizer.decode(ids[: int(n)].tolist(), skip_special_tokens=True)
                for ids, n in zip(response_ids, lengths, strict=True)]


__all__ = ["PromptCodec"]
