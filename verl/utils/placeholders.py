"""The `<image>` placeholder of prompts with images, shared by the data layer (which checks rows) and the models
layer (which renders them through a processor's chat template)."""

from __future__ import annotations

from typing import Any

IMAGE_PLACEHOLDER = "<image>"


def split_placeholders(text: str) -> list[dict[str, Any]]:
    """`"<image>What is shown?"` -> `[{"type": "image"}, {"type": "text", "text": "What is shown?"}]`: Hugging
    Face content parts, the form a vision-language processor's chat template reads."""
    parts: list[dict[str, Any]] = []
    for k, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


__all__ = ["IMAGE_PLACEHOLDER", "split_placeholders"]
