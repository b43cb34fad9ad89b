"""Model/tokenizer/processor checks for vision-language models: the image-token half of `verl.models.checks`.

Each mismatch here lets a run start and train on garbage: a tokenizer without `<|image_pad|>` splits the
placeholder into text pieces (the model never sees the image, or the forward fails on a feature count), an
`image_token_id` that is another token scatters image features onto text, a processor from another model cuts
images into patches of another size or merges another number of them per token than the vision tower expects.
Problems are collected into the same `LoadReport` (`load_hf_model` raises them together as a ModelError).
"""

from __future__ import annotations

from typing import Any

from verl.models.checks import LoadReport, _token_id, embedding_rows, vocabulary_difference
from verl.models.vision import (
    QWEN_VISION_TOKENS,
    image_processor_sizes,
    is_vision_language,
    vision_token_ids,
    vision_tower,
)
from verl.utils.tokenizer_protocol import Tokenizer

# Image processor attribute -> vision config attribute that must hold the same number.
SIZE_KEYS = {"patch_size": "patch_size", "merge_size": "spatial_merge_size",
             "temporal_patch_size": "temporal_patch_size"}
IMAGE_PROBE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]


def _expected_tokens(processor: Any) -> dict[str, str]:
    tokens = dict(QWEN_VISION_TOKENS)
    for attr, name in (("image_token", "image_token_id"), ("video_token", "video_token_id")):
        if isinstance(value := getattr(processor, attr, None), str):
            tokens[name] = value
    tokens["image_token_index"] = tokens["image_token_id"]
    return tokens


def vision_problems(model: Any, tokenizer: Tokenizer, processor: Any = None, *, where: str = "(model)",
                    tokenizer_key: str = "tokenizer_name", processor_source: str | None = None,
                    chat: bool | None = None) -> list[str]:
    """Every mismatch between a vision-language `model` (or its config, then no embedding-size check), its
    `tokenizer` and its `processor`, each saying what, where (`where`) and the fix. Empty for a text model."""
    config = getattr(model, "config", model)
    if not is_vision_language(config):
        return []
    problems: list[str] = []
    rows = embedding_rows(model) if hasattr(model, "get_input_embeddings") else None
    expected = _expected_tokens(processor)
    own = f"use the tokenizer that ships with the vision-language model (drop {tokenizer_key})"
    missing = []
    for name, token_id in vision_token_ids(config).items():
        token = expected[name]
        found = _token_id(tokenizer, token)
        if found is None:
            missing.append(f"{token!r} ({name}={token_id})")
        elif found != token_id:
            problems.append(
                f"config {name}={token_id} but the tokenizer encodes {token!r} as {found} {where}: image features "
                f"would be written over other tokens. Fix: {own}, or correct {name} in config.json to {found}.")
        if rows is not None and token_id >= rows:
            problems.append(f"config {name}={token_id} is >= the {rows} embedding rows {where}. Fix: correct {name} "
                            "in config.json, or use the checkpoint's own config.")
    if missing:
        problems.insert(0, (
            f"the tokenizer has no single token for {', '.join(missing)} {where}, which the model's config names: "
            "image placeholders would be split into text pieces and the model would never see the image (or the "
            f"forward fails counting image tokens). Fix: {own}; a text-only tokenizer lacks the vision tokens."))
    if processor is not None:
        problems += _processor_problems(config, tokenizer, processor, where, processor_source or "the processor",
                                        tokenizer_key)
    if chat is not False and getattr(tokenizer, "chat_template", None):
        problems += _template_problems(tokenizer, processor, expected["image_token_id"], where)
    return problems


def _processor_problems(config: Any, tokenizer: Tokenizer, processor: Any, where: str, source: str,
                        tokenizer_key: str) -> list[str]:
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        return [f"{source} ({type(processor).__name__}) is not a vision-language processor (no image processor "
                f"or no tokenizer) {where}. Fix: load it with verl.models.vision.load_processor(<model folder>) or "
                "AutoProcessor.from_pretrained(<model folder>)."]
    problems = []
    diff = vocabulary_difference(processor.tokenizer, tokenizer, names=("the processor's", "the model's"))
    if diff is not None:
        problems.append(
            f"the tokenizer inside {source} is not the model's tokenizer {where} ({diff}): prompts would be "
            "encoded with one vocabulary and read with another. Fix: use the processor of the same checkpoint as "
            f"the model (and the tokenizer that ships with it: drop {tokenizer_key}).")
    image_token_id = getattr(config, "image_token_id", None)
    processor_id = getattr(processor, "image_token_id", None)
    if image_token_id is not None and processor_id is not None and processor_id != image_token_id:
        problems.append(
            f"{source} expands images into token {getattr(processor, 'image_token', '?')!r} (id {processor_id}) but "
            f"the model's config has image_token_id={image_token_id} {where}: the model would find no image "
            "positions. Fix: use the processor of the same checkpoint as the model.")
    vision_config = getattr(config, "vision_config", None)
    for mine, theirs in SIZE_KEYS.items():
        have, want = image_processor_sizes(processor).get(mine), getattr(vision_config, theirs, None)
        if have is not None and isinstance(want, int) and have != want:
            problems.append(
                f"the image processor inside {source} has {mine}={have} but the vision tower's config has "
                f"{theirs}={want} {where}: images would be cut into patches the tower cannot read (or merged into "
                "the wrong number of tokens). Fix: use the processor of the same checkpoint as the model "
                f"(preprocessor_config.json next to config.json), or set {mine}={want} in preprocessor_config.json.")
    return problems


def _template_problems(tokenizer: Tokenizer, processor: Any, image_token: str, where: str) -> list[str]:
    template = getattr(processor, "chat_template", None) or None
    try:
        text = tokenizer.apply_chat_template(IMAGE_PROBE, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template that cannot render an image part is the finding
        text, error = "", f"it raised {type(exc).__name__}: {exc}"
    else:
        error = f"the rendered prompt has no {image_token!r}"
    if image_token in text:
        return []
    return [f"the chat template cannot render an image part {where} ({error}): chat prompts with images would "
            "lose them. Fix: use the vision-language model's own tokenizer and processor (their chat template "
            "renders {'type': 'image'} parts), or turn chat formatting off."]


def vision_summary(model: Any, processor: Any) -> str:
    """One line for the load report: tower size, patch/merge sizes, image token, processor class."""
    config = model.config
    tower = vision_tower(model)
    vision = getattr(config, "vision_config", None)
    sizes = ", ".join(f"{k} {getattr(vision, v, '?')}" for k, v in SIZE_KEYS.items())
    params = sum(p.numel() for p in tower[1].parameters())
    image = f"image token id {vision_token_ids(config).get('image_token_id', '?')}"
    return (f"{tower[0]}: {params:,} params; {sizes}; {image}; processor "
            f"{type(processor).__name__ if processor is not None else 'none'}")


def check_vision_model(model: Any, tokenizer: Tokenizer, processor: Any = None, *, source: str = "<model>",
                       chat: bool | None = None) -> None:
    """Raise one ModelError listing every `vision_problems` finding (the way `load_hf_model` reports them)."""
    report = LoadReport(model_source=source, tokenizer_source=source)
    report.problems = vision_problems(model, tokenizer, processor, where=f"({source})", chat=chat)
    if report.problems:
        report.raise_if_problems()


__all__ = ["IMAGE_PROBE", "SIZE_KEYS", "check_vision_model", "vision_problems", "vision_summary"]

