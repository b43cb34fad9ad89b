"""Tokenising SFT and preference rows with images for a vision-language model, as its processor would.

A normalised row holds one `<image>` placeholder per image in its text and light references in `images`
(`verl.data.images`). With a vision-language policy the trainer passes an :class:`ImageTokens` (built from the
model's processor by `verl.trainer.offline.vision.image_tokens`) to `SFTDataset` / `PreferenceDataset`, and a
row with images is tokenised the way the processor tokenises it for the sampler (`verl.rollout.prompts`):

- chat messages (or any row under `data.apply_chat_template=always`) go through the processor's chat template
  with an image part for each placeholder; raw text gets each placeholder replaced by the image's marker text
  (`<|vision_start|><|image_pad|><|vision_end|>` for Qwen-VL);
- each image's one pad token is then expanded to as many as the image has tokens after the processor's
  resize, computed from the image's header (no pixel is decoded here: `load_images` decodes them when a
  batch is built, and the trainer checks the count again against the processor's `image_grid_thw`).

Image tokens are prompt: they never carry a label. Length limits count the expanded tokens, and a truncation
that would cut into an image's tokens (or drop a whole image) refuses the row: its pixels would no longer
match its pad tokens. A row with images for a text-only policy is refused here, with its file and line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl.data.images import FIELD, PLACEHOLDER, image_sizes, to_content_parts
from verl.data.report import location
from verl.errors import DataError
from verl.utils.tokenizer_protocol import Tokenizer

IGNORE_INDEX = -100


@dataclass(frozen=True)
class ImageTokens:
    """What a vision-language model's processor contributes to tokenising rows with images."""

    tokenizer: Tokenizer  # the run's tokenizer (the processor's own, or one with the same vocabulary)
    chat_template: str | None  # the processor's chat template (None: the tokenizer's)
    marker: str  # one image in raw (untemplated) text, before expansion
    image_token_id: int  # the pad token each image expands
    tokens_per_image: Callable[[int, int], int]  # (height, width) -> the image's tokens after the resize

    @property
    def chat_tokenizer(self) -> Any:
        return _PartsTemplate(self.tokenizer, self.chat_template)


class _PartsTemplate:
    """The run's tokenizer whose chat template renders each `<image>` of a message as an image part (Hugging
    Face's content parts, the form a vision-language processor's template reads); everything else delegates."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None) -> None:
        self._tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> Any:
        return self._tokenizer.apply_chat_template(to_content_parts(messages), chat_template=self.chat_template,
                                                   **kwargs)


def _where(row: Mapping[str, Any]) -> str:
    if isinstance(row.get("file"), str) and isinstance(row.get("line"), int):
        return location(row["file"], row["line"])
    return "a row"


def has_images(row: Mapping[str, Any]) -> bool:
    return bool(row.get(FIELD))


def text_only_error(row: Mapping[str, Any]) -> DataError:
    n = len(row.get(FIELD) or [])
    return DataError(f"{_where(row)}: the row has {n} image(s), but the policy is a text-only model (no processor, "
                     "no vision tower), which would read its <image> placeholders as plain text. Fix: train a "
                     "vision-language model (model.path: a Qwen2-VL / Qwen2.5-VL checkpoint, or tiny:qwen2_5_vl), "
                     "or remove the rows' images")


def prepare(row: dict[str, Any], images: ImageTokens | None, tokenizer: Tokenizer, mode: str,
            fields: Sequence[str]) -> tuple[Any, dict[str, Any], list[int]]:
    """(tokenizer, row, image token counts) to tokenise `row` with by the text path (`verl.data.chat`): for a
    row without images the run's tokenizer, the row and []; for one with images, when it is templated (chat
    messages in `fields`, or `mode` "always") the tokenizer whose template renders image parts, else a copy of
    the row whose `fields` have each placeholder replaced by the marker text. A text-only policy
    (`images` None) refuses the row."""
    if not has_images(row):
        return tokenizer, row, []
    if images is None:
        raise text_only_error(row)
    counts = image_counts(row, images)
    if mode == "always" or any(isinstance(row.get(f), list) for f in fields):
        return images.chat_tokenizer, row, counts
    out = dict(row)
    for f in fields:
        if isinstance(out.get(f), str):
            out[f] = out[f].replace(PLACEHOLDER, images.marker)
    return images.tokenizer, out, counts


def image_counts(row: Mapping[str, Any], images: ImageTokens) -> list[int]:
    """Each of the row's images' token count, from its header (width x height through the processor's resize)."""
    return [int(images.tokens_per_image(h, w)) for w, h in image_sizes(row)]


def expand(ids: Sequence[int], labels: Sequence[int], counts: Sequence[int], images: ImageTokens,
           row: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """`ids` / `labels` with the k-th image pad token repeated `counts[k]` times (labels IGNORE_INDEX: image
    tokens are input). A pad-token count other than the row's images is a DataError (a template that drops
    image parts, or a placeholder typed into the text)."""
    pad = images.image_token_id
    found = sum(1 for t in ids if t == pad)
    if found != len(counts):
        raise DataError(f"{_where(row)}: the tokenised row has {found} image pad token(s) for {len(counts)} "
                        "image(s); write exactly one <image> per image in the prompt (and no image token text)")
    out_ids: list[int] = []
    out_labels: list[int] = []
    k = 0
    for t, lab in zip(ids, labels, strict=True):
        if t == pad:
            out_ids += [pad] * counts[k]
            out_labels += [IGNORE_INDEX] * counts[k]
            k += 1
        else:
            out_ids.append(t)
            out_labels.append(lab)
    return out_ids, out_labels


def check_kept(kept: Sequence[int], counts: Sequence[int], images: ImageTokens, row: Mapping[str, Any],
               max_length: int, truncation: str) -> None:
    """A truncated image row must keep every image token: cutting into one leaves pixels without their pad
    tokens (or pad tokens without pixels). DataError naming the row and the settings otherwise."""
    total = sum(counts)
    left = sum(1 for t in kept if t == images.image_token_id)
    if left != total:
        raise DataError(f"{_where(row)}: data.truncation={truncation} would cut into the row's image tokens (it has "
                        f"{total} for {len(counts)} image(s); {left} would remain within max_length={max_length}), "
                        "and an image's tokens are never cut. Fix: raise data.max_prompt_length + "
                        "data.max_response_length, use smaller images, or set data.truncation=drop")


__all__ = ["ImageTokens", "check_kept", "expand", "has_images", "image_counts", "prepare", "text_only_error"]
