"""Prompts with images in vLLM's multimodal format, from the prompts our processor already expanded.

`PromptCodec` expands each image's one `<|image_pad|>` into as many pad tokens as the image has after merging
(what the policy's forward and our sampler take). vLLM takes a tokenised prompt with images the other way round:
`{"prompt_token_ids": ids, "multi_modal_data": {"image": [PIL images]}}` where each image still has ONE pad
token, which vLLM's own processing replaces by the image's pad tokens (its "prompt updates"; token inputs skip
the Hugging Face processor's text step: vLLM's docs/design/mm_processing.md). So each row's runs of pad tokens are
collapsed to one pad each, after checking that the runs are exactly its images' (count and lengths): a prompt
whose pads do not match its images would sample from pixels placed on the wrong tokens, or fail inside vLLM
with an error that names no row. Only the prompt sent to vLLM changes: the batch keeps the expanded ids, over
which the trainer recomputes log-probs with the pixels.

A vision-language policy never samples its vision tokens (`verl.models.vision.unsampled_token_ids`: a pad in a
response has no pixels behind it); vLLM is told so with a logit bias of -100 on each (the bound vLLM's API
clamps to), which leaves them a probability below float32 resolution, as the trainer's softmax leaves them none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl.errors import DataError, ModelError
from verl.models.vision import is_vision_language, unsampled_token_ids, vision_token_ids
from verl.models.vision_inputs import RowImages, has_images

UNSAMPLED_LOGIT_BIAS = -100.0  # vLLM's OpenAI API clamps logit_bias to [-100, 100] (vllm/sampling_params.py)


def _get(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


@dataclass(frozen=True)
class VisionTokens:
    """What the vLLM engine needs of a vision-language policy's config."""

    image_token_id: int  # the pad token each image expands to
    # Qwen-VL's spatial merge: an image of grid (t, h, w) is t * h * w / merge_size^2 pad tokens (None: a model
    # without one, whose runs are checked by count only)
    merge_size: int | None
    unsampled: tuple[int, ...]  # the vision tokens no response may hold

    @classmethod
    def of(cls, config: Any) -> VisionTokens | None:
        """From the policy's Hugging Face config (a config object or dict); None for a text model."""
        if config is None or not is_vision_language(config):
            return None
        merge = _get(_get(config, "vision_config"), "spatial_merge_size")
        pad = vision_token_ids(config)
        return cls(int(pad.get("image_token_id", pad.get("image_token_index"))), int(merge) if merge else None,
                   tuple(unsampled_token_ids(config)))

    @property
    def logit_bias(self) -> dict[int, float]:
        return {t: UNSAMPLED_LOGIT_BIAS for t in self.unsampled}

    def runs_match(self, runs: list[int], row: RowImages) -> tuple[bool, str]:
        """Whether a row's pad runs are its images' (one run per image, of the image's length where the merge
        size gives it), and what the images take, for the error."""
        if self.merge_size is None:
            return len(runs) == row.count, f"{row.count} run(s)"
        want = (row.image_grid_thw.prod(-1) // self.merge_size**2).tolist()
        return runs == want, f"runs of {want}"


def pad_runs(tokens: Sequence[int], pad: int) -> tuple[list[int], list[int]]:
    """(`tokens` with each run of consecutive `pad` tokens collapsed to one, the length of each run in order)."""
    collapsed: list[int] = []
    runs: list[int] = []
    previous_was_pad = False
    for token in tokens:
        if token == pad:
            if previous_was_pad:
                runs[-1] += 1
                continue
            runs.append(1)
        previous_was_pad = token == pad
        collapsed.append(token)
    return collapsed, runs


def _row_prompt(i: int, tokens: list[int], row: RowImages | None, vision: VisionTokens | None) -> dict[str, Any]:
    if vision is None:
        return {"prompt_token_ids": tokens}
    pad = vision.image_token_id
    collapsed, runs = pad_runs(tokens, pad)
    if row is None:
        if runs:
            raise DataError(f"vLLM rollout, prompt row {i}: {sum(runs)} image pad token(s) (id {pad}) but no image. "
                            "Fix: let the processor write the image tokens (an <image> placeholder and the row's "
                            "`images`), do not type the model's image pad token into a prompt")
        return {"prompt_token_ids": tokens}
    if row.pictures is None:
        raise DataError(f"vLLM rollout, prompt row {i}: the row's images were not kept (RowImages.pictures is None), "
                        "and vLLM takes the images themselves, not pixels. Fix: build the prompts with "
                        "PromptCodec(..., keep_pictures=True), as the trainer does under rollout.engine=vllm")
    if len(row.pictures) != row.count:
        raise DataError(f"vLLM rollout, prompt row {i}: {len(row.pictures)} kept image(s) but {row.count} in its "
                        "pixels. Fix: build each row's RowImages from the same images (PromptCodec.encode_batch)")
    match, want = vision.runs_match(runs, row)
    if not match:
        raise DataError(
            f"vLLM rollout, prompt row {i}: its image pad tokens (id {pad}) form {len(runs)} run(s) of lengths "
            f"{runs}, but its {row.count} image(s) take {want}. vLLM puts one image on each run, so the "
            "pixels would land on the wrong tokens. Fix: one <image> placeholder per image, tokenised by the "
            "policy's processor (PromptCodec.encode_batch), and no image pad tokens typed into the prompt or cut "
            "from it")
    return {"prompt_token_ids": collapsed, "multi_modal_data": {"image": list(row.pictures)}}


def vllm_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, images: Sequence[RowImages | None] | None,
                 vision: VisionTokens | None) -> list[dict[str, Any]]:
    """One vLLM prompt per row of the left-padded `input_ids` [B, P]: its tokens, and for a row with images, one
    pad per image and the images (`vision`: the policy's image tokens, None for a text model)."""
    mask = attention_mask.bool().cpu()
    ids = input_ids.cpu()
    if has_images(images):
        if vision is None:
            raise ModelError("vLLM rollout: prompts with images, but the policy's config has no vision tower and "
                             "image token. Fix: sample them from a vision-language model (Qwen2-VL, Qwen2.5-VL)")
        if len(images) != ids.shape[0]:
            raise DataError(f"vLLM rollout: {len(images)} rows of images for {ids.shape[0]} prompts; pass one entry "
                            "(None for a row without images) per prompt")
    rows = list(images) if has_images(images) else [None] * ids.shape[0]
    return [_row_prompt(i, ids[i][mask[i]].tolist(), rows[i], vision) for i in range(ids.shape[0])]


__all__ = ["UNSAMPLED_LOGIT_BIAS", "VisionTokens", "pad_runs", "vllm_prompts"]
