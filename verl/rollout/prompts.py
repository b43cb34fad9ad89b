"""Prompt rows to token ids and response ids back to text, as every RL stage and the episodes see them.

One object (the tokenizer with `data.*`'s prompt rules) instead of a trainer reference, so the multi-turn
episodes and the demos receive exactly what they use. With a vision-language policy it also holds the
model's processor: rows with `images` become ids with each image's pad tokens expanded, plus the row's
pixels (`verl.models.vision_inputs.RowImages`), read from their files only now.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from verl.config.schema import DataConfig
from verl.data import PromptDataset
from verl.data.chat import template_mode
from verl.data.datasets import row_location
from verl.data.images import load_images
from verl.errors import DataError
from verl.models.vision import batch_processor_inputs
from verl.models.vision_inputs import RowImages, rows_of
from verl.utils.tokenizer_protocol import Tokenizer


class Prompts(NamedTuple):
    """A batch of prompts as the sampler takes them: left-padded `ids` and `mask` [B, P], and each row's
    images (None for a batch without any)."""

    ids: torch.Tensor
    mask: torch.Tensor
    images: list[RowImages | None] | None = None


@dataclass(frozen=True)
class PromptCodec:
    tokenizer: Tokenizer
    data: DataConfig
    processor: Any = None  # a vision-language policy's processor (`verl.models.vision.load_processor`)
    # Keep each row's decoded images on its RowImages (`pictures`): vLLM runs the processor on them itself. Off
    # for our own sampler, which needs only the pixels, so a batch does not hold its images twice.
    keep_pictures: bool = False

    def encode(self, rows: Sequence[Mapping[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and mask of text rows, through the data layer's `PromptDataset` (chat template,
        length limit). Rows are never dropped here, since each one owns n responses; `data.truncation=drop`
        already filtered over-long rows when the files were read, so a long prompt left now is an error."""
        pictured = next((r for r in rows if r.get("images")), None)
        if pictured is not None and self.processor is None:
            raise DataError(f"{row_location(pictured)}: the row has images, but the policy takes text only. "
                            "Fix: train a vision-language model (Qwen2-VL, Qwen2.5-VL), or drop the rows' images")
        if pictured is not None:  # encode_batch takes images; what calls this (multi-turn episodes) does not
            raise DataError(f"{row_location(pictured)}: the row has images, but multi-turn episodes and agents "
                            "take text prompts only. Fix: use single-turn rollouts for rows with images")
        d = self.data
        truncation = "truncate_left" if d.truncation == "truncate_left" else "error"
        data = PromptDataset([dict(r) for r in rows], self.tokenizer, d.max_prompt_length, truncation,
                             d.apply_chat_template)
        batch = data.collate([data[i] for i in range(len(data))])
        return batch["input_ids"], batch["attention_mask"]

    def encode_batch(self, rows: Sequence[Mapping[str, Any]]) -> Prompts:
        """The sampler's prompts: through the processor with a vision-language policy (`encode_images`), else
        `encode`'s."""
        return self.encode_images(rows) if self.processor is not None else Prompts(*self.encode(rows))

    def encode_images(self, rows: Sequence[Mapping[str, Any]]) -> Prompts:
        """Prompts through the processor: each image's `<image>` placeholder becomes its pad tokens (as many as
        its patches after merging), text rows as they are. The chat template applies as `data.apply_chat_template`
        says (`auto`: to chat messages only). A prompt over `data.max_prompt_length` is an error naming its row:
        cutting it could split an image's tokens from its pixels."""
        images = [load_images(r) for r in rows]
        always = template_mode(self.data.apply_chat_template) == "always"  # chat messages take it either way
        inputs = batch_processor_inputs(self.processor, images, [r["prompt"] for r in rows], chat=always,
                                        padding_side="left")
        lengths = inputs["attention_mask"].sum(-1)
        limit = self.data.max_prompt_length
        for row, length in zip(rows, lengths.tolist(), strict=True):
            if length > limit:
                raise DataError(f"{row_location(row)}: the prompt has {length} tokens with its images' tokens, more "
                                f"than data.max_prompt_length={limit}; raise data.max_prompt_length or use smaller "
                                "images (an image's tokens are never cut)")
        pictures = images if self.keep_pictures else None
        return Prompts(inputs["input_ids"], inputs["attention_mask"],
                       rows_of(inputs, [len(i) for i in images], pictures))

    def decode(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
        lengths = response_mask.sum(-1).tolist()
        return [self.tokenizer.decode(ids[: int(n)].tolist(), skip_special_tokens=True)
                for ids, n in zip(response_ids, lengths, strict=True)]


__all__ = ["PromptCodec", "Prompts"]
