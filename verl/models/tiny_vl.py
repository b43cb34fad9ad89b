"""Tiny local vision-language models (Qwen2.5-VL / Qwen2-VL architecture) for tests and the vision demo.

The language half is the `tiny` instruct model's recipe (same BPE pipeline, ChatML, 64 hidden, 2 layers); the
tokenizer adds Qwen-VL's vision tokens (`VISION_TOKENS`) and its chat template renders image parts as
Qwen2.5-VL's does (`<|vision_start|><|image_pad|><|vision_end|>`). The vision tower is 2 blocks of width 32
with Qwen's 14-pixel patches and 2x2 spatial merge, so one image token covers 28x28 pixels; the image
processor (the PIL one: torchvision is not needed) is set to 28*28..84*84 pixels, so a 28x28..64x64 image
becomes 1..4 image tokens. Everything is built from a seed in about a second and cached like the text models.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from verl.errors import ModelError
from verl.models import tiny_base as tiny

VL_ARCHS = ("qwen2_5_vl", "qwen2_vl")
TINY_VL_FORMAT_VERSION = 1

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
# In Qwen's order; the config names each one's id (image_token_id, ...).
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
VISION_TOKEN_IDS = {"vision_start_token_id": VISION_START, "vision_end_token_id": VISION_END,
                    "image_token_id": IMAGE_PAD, "video_token_id": VIDEO_PAD}

# Qwen2-VL / Qwen2.5-VL-Instruct's chat template (a default system turn; an image part renders as its three
# tokens, which the processor expands to one <|image_pad|> per merged patch).
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PROCESSOR_CLASSES = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen2_vl": "Qwen2VLProcessor"}


def _vl_params(arch: str, seed: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
               intermediate_size: int, vocab_size: int, max_position_embeddings: int, rope_theta: float,
               vision: dict[str, int]) -> dict[str, Any]:
    params = tiny._params("vl", arch, "instruct", seed, hidden_size, num_layers, num_heads, num_kv_heads,
                          intermediate_size, vocab_size, max_position_embeddings, rope_theta)
    params["format_version"] = f"{tiny.TINY_FORMAT_VERSION}.vl{TINY_VL_FORMAT_VERSION}"
    params["vision"] = dict(sorted(vision.items()))
    return params


def _mrope_section(head_dim: int) -> list[int]:
    """Qwen's [16, 24, 24] of a 128 head dim, scaled to `head_dim`: temporal, height and width rotary pairs."""
    half = head_dim // 2
    t = max(1, half // 4)
    h = (half - t) // 2
    return [t, h, half - t - h]


def _tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    specials = [tiny.ENDOFTEXT, tiny.IM_START, tiny.IM_END] + VISION_TOKENS
    backend = tiny._train_backend(vocab_size - len(specials), specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=tiny.IM_END, pad_token=tiny.ENDOFTEXT, unk_token=None, bos_token=None,
        model_max_length=32768, padding_side="right", clean_up_tokenization_spaces=False,
        additional_special_tokens=specials[1:])
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    return tokenizer


def _config(params: dict[str, Any], tokenizer):
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_TOKEN_IDS.items()}
    vision = params["vision"]
    head_dim = params["hidden_size"] // params["num_heads"]
    text = dict(
        vocab_size=len(tokenizer), hidden_size=params["hidden_size"], intermediate_size=params["intermediate_size"],
        num_hidden_layers=params["num_layers"], num_attention_heads=params["num_heads"],
        num_key_value_heads=params["num_kv_heads"], max_position_embeddings=params["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": params["rope_theta"],
                         "mrope_section": _mrope_section(head_dim)},
        rms_norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=True, use_cache=True, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    common = dict(patch_size=vision["patch_size"], spatial_merge_size=vision["merge_size"],
                  temporal_patch_size=vision["temporal_patch_size"], num_heads=vision["heads"],
                  depth=vision["depth"], in_channels=3)
    if params["arch"] == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config

        vision_config = dict(common, hidden_size=vision["hidden"], intermediate_size=2 * vision["hidden"],
                             out_hidden_size=params["hidden_size"], fullatt_block_indexes=[vision["depth"] - 1],
                             window_size=4 * vision["patch_size"] * vision["merge_size"], tokens_per_second=2)
    else:
        from transformers import Qwen2VLConfig as Config

        vision_config = dict(common, embed_dim=vision["hidden"], mlp_ratio=2, hidden_size=params["hidden_size"])
    return Config(text_config=text, vision_config=vision_config, tie_word_embeddings=True, **ids)


def _image_processor(vision: dict[str, int]):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=vision["min_pixels"], max_pixels=vision["max_pixels"], patch_size=vision["patch_size"],
        merge_size=vision["merge_size"], temporal_patch_size=vision["temporal_patch_size"])


def _write_vl(params: dict[str, Any], directory: Path) -> None:
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from verl.models.hf_loader import quiet_hf_progress

    tokenizer = _tokenizer(params["vocab_size"])
    config = _config(params, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params["seed"])
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids(tiny.IM_END), tokenizer.convert_tokens_to_ids(tiny.ENDOFTEXT)],
        pad_token_id=tokenizer.pad_token_id)
    with quiet_hf_progress():
        tiny.save_model(model, directory)
        tokenizer.save_pretrained(str(directory))
        _image_processor(params["vision"]).save_pretrained(str(directory))
    # What ProcessorMixin.save_pretrained writes; written by hand because the processor class cannot be built
    # without torchvision (its video processor needs it), while the image-only one here does not.
    (directory / "processor_config.json").write_text(
        json.dumps({"processor_class": PROCESSOR_CLASSES[params["arch"]]}, indent=2) + "\n")
    tiny._verify_tokenizer_roundtrip(tokenizer, directory)
    from verl.models.vision import load_processor

    processor = load_processor(str(directory))
    if processor.image_token_id != config.image_token_id:
        raise ModelError(f"tiny VL build at {directory}: the reloaded processor's image token id "
                         f"{processor.image_token_id} is not the config's {config.image_token_id}; please report it.")
    (directory / tiny.MARKER_FILE).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")


def build_tiny_vl_model(
    path: str | os.PathLike | None = None,
    *,
    arch: str = "qwen2_5_vl",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int = 768,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
    vision_hidden_size: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    patch_size: int = 14,
    merge_size: int = 2,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> str:
    """Build (or reuse from the cache) a tiny Qwen2.5-VL (`arch="qwen2_5_vl"`) or Qwen2-VL (`"qwen2_vl"`) model,
    tokenizer and image processor; returns the folder, which `load_hf_model` and `verl.models.vision.load_processor`
    load (and `AutoProcessor` too where torchvision is installed). Pixels default to one..nine merged patches."""
    where = "build_tiny_vl_model"
    if arch not in VL_ARCHS:
        raise ModelError(f"{where}: arch={arch!r} is not a vision-language architecture; use one of "
                         f"{', '.join(VL_ARCHS)}.")
    intermediate = intermediate_size if intermediate_size is not None else 4 * hidden_size
    tiny._validate("qwen2", "instruct", hidden_size, num_layers, num_heads, num_kv_heads, intermediate,
                   vocab_size, rope_theta)
    if (hidden_size // num_heads) < 6:
        raise ModelError(f"{where}: head dim hidden_size/num_heads={hidden_size // num_heads} is below 6; "
                         "multimodal rotary embeddings split it into temporal, height and width parts.")
    for name, value in (("vision_hidden_size", vision_hidden_size), ("vision_depth", vision_depth),
                        ("vision_heads", vision_heads), ("patch_size", patch_size), ("merge_size", merge_size)):
        if value < 1:
            raise ModelError(f"{where}: {name}={value} must be a positive integer.")
    if vision_hidden_size % vision_heads or (vision_hidden_size // vision_heads) % 4:
        raise ModelError(f"{where}: vision_hidden_size={vision_hidden_size} / vision_heads={vision_heads} must "
                         "be a whole multiple of 4 (the vision tower's 2-D rotary embedding).")
    unit = patch_size * merge_size
    vision = {"hidden": vision_hidden_size, "depth": vision_depth, "heads": vision_heads, "patch_size": patch_size,
              "merge_size": merge_size, "temporal_patch_size": 2,
              "min_pixels": min_pixels if min_pixels is not None else unit * unit,
              "max_pixels": max_pixels if max_pixels is not None else 9 * unit * unit}
    params = _vl_params(arch, seed, hidden_size, num_layers, num_heads, num_kv_heads, intermediate, vocab_size,
                        max_position_embeddings, rope_theta, vision)
    return tiny._build(params, path, write=_write_vl)


__all__ = ["build_tiny_vl_model", "QWEN_VL_TEMPLATE", "VISION_TOKENS", "VISION_TOKEN_IDS", "VL_ARCHS",
           "IMAGE_PAD", "VIDEO_PAD", "VISION_START", "VISION_END"]
