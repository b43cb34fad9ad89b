"""Image rows in the offline trainers (SFT, DPO): a vision-language policy's processor, turned into what the
datasets tokenise with (`image_tokens`) and what a forward over a micro-batch's rows takes (`RowPixels`).

The datasets expand each image's pad token from the image's header (`verl.data.image_tokens`); the pixels are
decoded only when a micro-batch is built (`RowPixels.load`), through the processor's image processor, and the
image's token count is checked again against its `image_grid_thw` (an image file changed since start-up would
otherwise feed pixels that do not match the row's pad tokens). The forward then takes
`verl.models.vision_inputs.image_forward_inputs` for the micro-batch's rows (`target_logprobs` does it when a
batch has `images`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from verl.config.schema import RunConfig
from verl.data.image_tokens import ImageTokens
from verl.data.images import load_images
from verl.data.report import location
from verl.errors import ConfigError, DataError
from verl.models.vision import (
    IMAGE_PLACEHOLDER,
    image_processor_sizes,
    num_image_tokens,
    render_vision_prompt,
)
from verl.models.vision_inputs import RowImages

ImageEntry = tuple[Sequence[Any], Sequence[int]]  # a row's image references and each image's token count


def image_tokens(processor: Any) -> ImageTokens | None:
    """What the datasets tokenise rows with images with, from a vision-language policy's processor (None for
    a text-only policy: the datasets then refuse such rows, naming them)."""
    if processor is None:
        return None
    pad = getattr(processor, "image_token_id", None)
    if pad is None:
        pad = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return ImageTokens(tokenizer=processor.tokenizer, chat_template=getattr(processor, "chat_template", None),
                       marker=render_vision_prompt(processor, IMAGE_PLACEHOLDER, 1, chat=False),
                       image_token_id=int(pad), tokens_per_image=functools.partial(num_image_tokens, processor))


class RowPixels:
    """Loads a row's images for a forward: decoded on demand, through the processor's image processor."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.merge = image_processor_sizes(processor).get("merge_size", 1) ** 2

    def load(self, entry: ImageEntry | None, row: Mapping[str, Any] | None = None) -> RowImages | None:
        """The row's `RowImages` (None for a text row); a count that differs from its pad tokens is a DataError."""
        if entry is None:
            return None
        refs, counts = entry
        pictures = load_images(dict(row or {}, images=list(refs)))
        out = self.processor.image_processor(images=pictures, return_tensors="pt")
        grid = out["image_grid_thw"]
        got = (grid.prod(-1) // self.merge).tolist()
        if got != list(counts):
            where = (location(row["file"], row["line"]) + ": " if row and isinstance(row.get("file"), str)
                     and isinstance(row.get("line"), int) else "")
            raise DataError(f"{where}the row's images now make {got} image tokens, but it was tokenised with "
                            f"{list(counts)} (an image file changed since start-up?). Fix: restore the images, or "
                            "restart so the rows are tokenised again")
        return RowImages(out["pixel_values"], grid)

    def load_all(self, entries: Sequence[ImageEntry | None],
                 rows: Sequence[Mapping[str, Any] | None] | None = None) -> list[RowImages | None] | None:
        """Each row's images, or None when no row has any (a text micro-batch takes the plain forward)."""
        if not any(e is not None for e in entries):
            return None
        rows = rows if rows is not None else [None] * len(entries)
        return [self.load(e, r) for e, r in zip(entries, rows, strict=True)]


def refuse_unsupported(config: RunConfig, trainer: str, image_rows: int) -> None:
    """The offline paths that do not take images yet, refused with the key to turn off: packed SFT rows and
    sequence parallelism (both would need multimodal positions per packed segment / per split)."""
    if not image_rows:
        return
    problems = []
    if trainer == "sft" and config.sft.packing:
        problems.append("sft.packing=true packs rows into one sequence; set sft.packing=false")
    if config.actor.sequence_parallel_size > 1:
        problems.append(f"actor.sequence_parallel_size={config.actor.sequence_parallel_size} splits sequences over "
                        "ranks; set actor.sequence_parallel_size=1")
    if problems:
        raise ConfigError(f"{image_rows} {trainer.upper()} row(s) have images, which these settings do not take "
                          f"yet: {'; '.join(problems)}")


__all__ = ["ImageEntry", "RowPixels", "image_tokens", "refuse_unsupported"]
