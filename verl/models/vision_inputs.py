"""A row's images as a vision-language model takes them, and the extra inputs of a forward over such rows.

Every stage that runs the policy, the reference or a trained model over rows with images (the sampler's
prefill, log-prob recomputation, the update, SFT and DPO) passes the same three things beside the token ids:
the rows' `pixel_values` and `image_grid_thw`, concatenated in row order, and the multimodal rotary positions
([3, B, T]) that the model's own `get_rope_index` gives for those ids and that mask. A row keeps its images as
one :class:`RowImages`, so selecting rows (mini-batches, groups of samples, ranks) moves its pixels with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verl.errors import DataError
from verl.models.vision import mrope_position_ids, split_images_by_row


@dataclass(frozen=True)
class RowImages:
    """One row's images: `pixel_values` [patches, 3 * temporal * patch^2], `image_grid_thw` [images, 3], and
    `pictures`, the decoded images themselves, for an engine that runs the model's processor on its own (vLLM
    takes PIL images): kept only where that engine samples (`PromptCodec.keep_pictures`), else None."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    pictures: tuple[Any, ...] | None = field(default=None, compare=False, repr=False)

    @property
    def count(self) -> int:
        return int(self.image_grid_thw.shape[0])


def rows_of(inputs: Mapping[str, Any], images_per_row: Sequence[int],
            pictures: Sequence[Sequence[Any]] | None = None) -> list[RowImages | None]:
    """Each row's images from a processor's batch output (`verl.models.vision.batch_processor_inputs`), None for
    a row without any; `pictures` (each row's decoded images, as given to the processor) are kept beside them."""
    if "pixel_values" not in inputs or not any(images_per_row):
        return [None] * len(images_per_row)
    split = split_images_by_row(inputs["pixel_values"], inputs["image_grid_thw"], images_per_row)
    kept = [tuple(row) for row in pictures] if pictures is not None else [None] * len(images_per_row)
    return [RowImages(p, g, k) if n else None
            for (p, g), n, k in zip(split, images_per_row, kept, strict=True)]


def has_images(rows: Sequence[RowImages | None] | None) -> bool:
    return bool(rows) and any(r is not None for r in rows)


def images_kwarg(rows: Sequence[RowImages | None] | None) -> dict[str, Any]:
    """`{"images": rows}` for an engine's `generate` where a row has images, else {}: a text batch calls an
    engine exactly as before images existed (one written without the argument keeps working)."""
    return {"images": list(rows)} if has_images(rows) else {}


def image_forward_inputs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         rows: Sequence[RowImages | None] | None) -> dict[str, Any]:
    """The extra keyword arguments of a forward of `input_ids` [B, T] (row i with `rows[i]`'s images):
    `pixel_values`, `image_grid_thw` (on the ids' device) and `position_ids` [3, B, T]; {} when no row has an
    image (text rows take the plain positions). The ids must hold each image's expanded pad tokens."""
    if not has_images(rows):
        return {}
    if len(rows) != input_ids.shape[0]:
        raise DataError(f"{len(rows)} rows of images for a batch of {input_ids.shape[0]} sequences; pass one entry "
                        "(None for a row without images) per sequence.")
    present = [r for r in rows if r is not None]
    device = input_ids.device
    grid = torch.cat([r.image_grid_thw for r in present]).to(device)
    pixels = torch.cat([r.pixel_values for r in present]).to(device)
    positions, _ = mrope_position_ids(model, input_ids, attention_mask, grid)
    return {"pixel_values": pixels, "image_grid_thw": grid, "position_ids": positions.to(device)}


__all__ = ["RowImages", "has_images", "image_forward_inputs", "images_kwarg", "rows_of"]
