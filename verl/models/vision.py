"""Vision-language models (Qwen2-VL / Qwen2.5-VL): what the trainer and the sampler need beyond a causal LM.

- `is_vision_language`: whether a model/config has a vision tower (then it is loaded with its processor).
- `load_processor`: the model's processor; where transformers cannot build it (its video processor needs
  torchvision, which verl does not require) an image-only processor of the same class, same outputs for images.
- `processor_inputs` / `batch_processor_inputs`: images + a prompt (text or chat messages with `<image>`
  placeholders) -> input_ids with each image's pad token expanded, pixel_values, image_grid_thw, ...
- `vision_tower`, `set_vision_trainable`, `count_vision_parameters`: the tower to freeze or train, and its size.
- `mrope_position_ids` / `mrope_decode_position_ids`: the multimodal rotary positions ([3, B, T]: temporal,
  height, width) from the model's own `get_rope_index`, for a prefill with images and the decode steps after it.

Pillow is imported only when images are processed (`verl.utils.pillow`), never at `import verl`.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from verl.errors import DataError, ModelError
from verl.utils.placeholders import IMAGE_PLACEHOLDER, split_placeholders
from verl.utils.tokenizer_protocol import Tokenizer

# The config attribute of each vision token and the token text Qwen-VL tokenizers use for it.
QWEN_VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                      "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
# Processor classes whose image path works without torchvision (see `load_processor`).
IMAGE_ONLY_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")
# Attribute paths of the vision tower, newest transformers first (5.x nests it in the base model).
TOWER_PATHS = ("model.visual", "visual", "backbone.visual", "model.vision_tower", "vision_tower", "model.vision_model",
               "vision_model")  # backbone.visual: a critic's (`verl.models.critic.ValueModel` on the VL base model)


def _config_of(obj: Any) -> Any:
    if isinstance(obj, (str, os.PathLike)):
        path = Path(obj).expanduser() / "config.json"
        return json.loads(path.read_text()) if path.is_file() else {}
    return getattr(obj, "config", obj)


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def is_vision_language(model_or_config: Any) -> bool:
    """True for a model (or its config, config dict or local folder) with a vision tower: a `vision_config`
    and an image token id (Qwen2-VL, Qwen2.5-VL and the other image-text-to-text models of transformers)."""
    config = _config_of(model_or_config)
    has_image_token = any(_get(config, n) is not None for n in ("image_token_id", "image_token_index"))
    return _get(config, "vision_config") is not None and has_image_token


def vision_token_ids(model_or_config: Any) -> dict[str, int]:
    """The config's vision token ids by name (image_token_id, video_token_id, vision_start/end_token_id).
    A sampler must never emit them: an image pad in a response has no pixels, and the next forward fails."""
    config = _config_of(model_or_config)
    names = (*QWEN_VISION_TOKENS, "image_token_index")
    return {n: int(v) for n in names if (v := _get(config, n)) is not None}


def unsampled_token_ids(model_or_config: Any) -> list[int]:
    """The token ids a vision-language policy never samples and so gives no probability: its vision tokens
    (`vision_token_ids`); [] for a text model. The sampler takes them out of every draw, and the trainer's
    log-probs out of every softmax, so both see one distribution."""
    return sorted(set(vision_token_ids(model_or_config).values())) if is_vision_language(model_or_config) else []


# ----------------------------------------------------------------------------------------------- processor


def _processor_class_name(name: str, revision: str | None) -> str | None:
    path = Path(name).expanduser()
    for file in ("processor_config.json", "preprocessor_config.json"):
        if (path / file).is_file():
            try:
                found = json.loads((path / file).read_text()).get("processor_class")
            except (OSError, ValueError):
                found = None
            if found:
                return found
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    try:
        model_type = AutoConfig.from_pretrained(name, revision=revision).model_type
    except (OSError, ValueError, KeyError):
        return None
    return PROCESSOR_MAPPING_NAMES.get(model_type)


def image_only_processor_class(base: type) -> type:
    """`base` (a Qwen-VL processor class) without its video processor: transformers builds the video processor
    for every load and it needs torchvision; images go through exactly `base`'s code."""
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyProcessor(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or QWEN_VISION_TOKENS["image_token_id"]
            self.video_token = getattr(tokenizer, "video_token", None) or QWEN_VISION_TOKENS["video_token_id"]
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        def to_dict(self) -> dict[str, Any]:  # saved as `base`: a folder any transformers loads as the model's own
            out = super().to_dict()
            out["processor_class"] = base.__name__
            return out

        def save_pretrained(self, save_directory: Any, **kwargs: Any) -> Any:
            """`base`'s files plus preprocessor_config.json, from which transformers builds the image processor
            and, where torchvision is, the video processor (as for a hub checkpoint)."""
            saved = super().save_pretrained(save_directory, **kwargs)
            self.image_processor.save_pretrained(save_directory)
            return saved

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"{base.__name__}ImageOnly"
    return ImageOnlyProcessor


def load_processor(name_or_path: str | os.PathLike, *, tokenizer: Tokenizer | None = None, revision: str | None = None,
                   trust_remote_code: bool = False) -> Any:
    """The processor of a vision-language model (tokenizer + image processor + chat template).

    `tokenizer`: one already loaded to use inside it (else the folder's own). Without torchvision,
    transformers cannot build a Qwen-VL processor at all (it builds the video processor too); then this returns
    `image_only_processor_class(<the class>)` built from the folder's tokenizer and PIL image processor, which
    processes images with the same code and refuses videos. Other failures raise ModelError with the fix."""
    from transformers import AutoProcessor

    from verl.utils.pillow import require_pillow

    name = os.fspath(name_or_path)
    require_pillow(f"the processor of vision-language model {name!r}")  # every image processor needs it
    extra = {"tokenizer": tokenizer} if tokenizer is not None else {}
    try:
        return AutoProcessor.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code, **extra)
    except ImportError as exc:
        if "torchvision" not in str(exc).lower():
            raise ModelError(f"could not load the processor of {name!r}: {exc}. Fix: install the package it "
                             "names.") from exc
        cls_name = _processor_class_name(name, revision)
        if cls_name not in IMAGE_ONLY_PROCESSORS:
            raise ModelError(f"the processor of {name!r} ({cls_name or 'unknown class'}) needs torchvision, which "
                             "is not installed. Fix: pip install torchvision (matching your torch build).") from exc
        return _image_only(name, cls_name, tokenizer, revision, trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"could not load the processor of vision-language model {name!r}: {type(exc).__name__}: "
                         f"{exc}. Fix: the model folder needs preprocessor_config.json and the tokenizer files "
                         "(copy them from the original checkpoint).") from exc


def _image_only(name: str, cls_name: str, tokenizer: Tokenizer | None, revision: str | None,
                trust_remote_code: bool) -> Any:
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    try:
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(name, revision=revision, trust_remote_code=trust_remote_code)
        image_processor = AutoImageProcessor.from_pretrained(name, revision=revision)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        raise ModelError(f"could not load the image processor or tokenizer of {name!r}: {type(exc).__name__}: "
                         f"{exc}. Fix: the folder needs preprocessor_config.json and the tokenizer files.") from exc
    cls = image_only_processor_class(getattr(transformers, cls_name))
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def image_processor_sizes(processor: Any) -> dict[str, int]:
    """patch_size, merge_size, temporal_patch_size of the processor's image processor (those it has)."""
    image_processor = getattr(processor, "image_processor", None)
    names = ("patch_size", "merge_size", "temporal_patch_size")
    return {n: int(v) for n in names if isinstance(v := getattr(image_processor, n, None), int)}


def num_image_tokens(processor: Any, height: int, width: int) -> int:
    """How many image tokens one `height` x `width` image becomes (after the processor's resize), for the memory
    plan and `verl check`."""
    image_processor = processor.image_processor
    patches = image_processor.get_number_of_image_patches(height, width, {})
    return int(patches) // int(getattr(image_processor, "merge_size", 1)) ** 2


# -------------------------------------------------------------------------------------------------- inputs


def _count_images(content: Any) -> int:
    if isinstance(content, str):
        return content.count(IMAGE_PLACEHOLDER)
    return sum(1 for p in content if isinstance(p, dict) and (p.get("type") == "image" or "image" in p))


def vision_messages(prompt: str | Sequence[dict[str, Any]], num_images: int, *, where: str = "prompt") -> list[dict]:
    """Chat messages with an image part for each `<image>` placeholder (images with no placeholder at all go
    first in the first user turn, as TRL does); a placeholder count other than `num_images` is a DataError."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    found = sum(_count_images(m.get("content", "")) for m in messages)
    if found == 0 and num_images:
        first = next((m for m in messages if m.get("role") == "user"), messages[0])
        content = first.get("content", "")
        first["content"] = [{"type": "image"}] * num_images + (split_placeholders(content) if isinstance(content, str)
                                                               else list(content))
    elif found != num_images:
        raise DataError(f"{where}: {found} image placeholder(s) ({IMAGE_PLACEHOLDER!r} or image parts) but "
                        f"{num_images} image(s). Fix: put one {IMAGE_PLACEHOLDER} where each image goes, or none "
                        "to put all images before the first user text.")
    for m in messages:
        if isinstance(m.get("content"), str) and IMAGE_PLACEHOLDER in m["content"]:
            m["content"] = split_placeholders(m["content"])
    return messages


def _image_text(processor: Any) -> str:
    tokenizer = processor.tokenizer
    start, end = QWEN_VISION_TOKENS["vision_start_token_id"], QWEN_VISION_TOKENS["vision_end_token_id"]
    if start in tokenizer.get_vocab() and end in tokenizer.get_vocab():
        return start + processor.image_token + end
    return processor.image_token


def render_vision_prompt(processor: Any, prompt: str | Sequence[dict[str, Any]], num_images: int, *,
                         chat: bool = True, add_generation_prompt: bool = True, where: str = "prompt") -> str:
    """The prompt text with one image marker per image (not yet expanded to the image's token count):
    chat-formatted with the processor's template, or plain text with `<image>` replaced (`chat=False`)."""
    if chat or not isinstance(prompt, str):
        messages = vision_messages(prompt, num_images, where=where)
        template = getattr(processor, "chat_template", None) or None
        return processor.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                       add_generation_prompt=add_generation_prompt)
    found = prompt.count(IMAGE_PLACEHOLDER)
    if found == 0:
        return _image_text(processor) * num_images + prompt
    if found != num_images:
        raise DataError(f"{where}: {found} {IMAGE_PLACEHOLDER} placeholder(s) but {num_images} image(s). Fix: one "
                        f"{IMAGE_PLACEHOLDER} per image, or none.")
    return prompt.replace(IMAGE_PLACEHOLDER, _image_text(processor))


def batch_processor_inputs(processor: Any, images: Sequence[Sequence[Any]], prompts: Sequence[Any], *,
                           chat: bool = True, add_generation_prompt: bool = True,
                           padding_side: str = "left") -> dict[str, torch.Tensor]:
    """Tensors for a batch of rows (row i: `images[i]`, a list of PIL images, and `prompts[i]`): `input_ids`,
    `attention_mask`, `mm_token_type_ids` [B, T] (padded on `padding_side`), `pixel_values` [sum of patches,
    3*2*patch^2] and `image_grid_thw` [number of images, 3] in row order (absent when no row has an image)."""
    from verl.utils.pillow import require_pillow

    if len(images) != len(prompts):
        raise DataError(f"batch_processor_inputs: {len(images)} image lists for {len(prompts)} prompts; pass one "
                        "(possibly empty) image list per prompt.")
    flat = [image for row in images for image in row]
    if flat:
        require_pillow("batch_processor_inputs")
    texts = [render_vision_prompt(processor, p, len(row), chat=chat, add_generation_prompt=add_generation_prompt,
                                  where=f"row {i}") for i, (p, row) in enumerate(zip(prompts, images, strict=True))]
    out = processor(text=texts, images=flat or None, return_tensors="pt", padding=True, padding_side=padding_side,
                    add_special_tokens=False)
    return dict(out)


def processor_inputs(processor: Any, images: Sequence[Any], prompt: str | Sequence[dict[str, Any]], *,
                     chat: bool = True, add_generation_prompt: bool = True) -> dict[str, torch.Tensor]:
    """`batch_processor_inputs` for one row: `images` (PIL images) and its prompt text or chat messages."""
    return batch_processor_inputs(processor, [list(images)], [prompt], chat=chat,
                                  add_generation_prompt=add_generation_prompt)


def split_images_by_row(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                        images_per_row: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(pixel_values, image_grid_thw) of each row, for moving rows between mini-batches and ranks: an image
    is `grid.prod()` rows of `pixel_values`; `cat_image_rows` puts rows back together."""
    if sum(images_per_row) != image_grid_thw.shape[0]:
        raise DataError(f"split_images_by_row: the rows hold {sum(images_per_row)} images but image_grid_thw has "
                        f"{image_grid_thw.shape[0]}.")
    patches = image_grid_thw.prod(-1).tolist()
    out, image, row_start = [], 0, 0
    for n in images_per_row:
        count = sum(patches[image:image + n])
        out.append((pixel_values[row_start:row_start + count], image_grid_thw[image:image + n]))
        image, row_start = image + n, row_start + count
    return out


def cat_image_rows(rows: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `split_images_by_row` for the rows of a (mini-)batch, in their order."""
    return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])


# -------------------------------------------------------------------------------------------- vision tower


def _unwrap(model: Any) -> Any:
    get_base = getattr(model, "get_base_model", None)  # a peft model
    return get_base() if callable(get_base) else model


def vision_tower(model: Any) -> tuple[str, torch.nn.Module]:
    """(name, module) of the vision tower: `model.visual` in transformers 5 (`visual` on older ones); the name
    is its prefix in `model.named_parameters()`, also through a peft wrapper."""
    base = _unwrap(model)
    for path in TOWER_PATHS:
        module = base
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, torch.nn.Module):
            name = next(n for n, m in model.named_modules() if m is module)
            return name, module
    raise ModelError(f"{type(base).__name__} has no vision tower (looked for {', '.join(TOWER_PATHS)}). Fix: pass "
                     "a vision-language model (e.g. Qwen2.5-VL), or do not ask to freeze/count its vision tower.")


def vision_parameter_names(model: Any) -> list[str]:
    """The names (in `model.named_parameters()`) of the vision tower's parameters."""
    name, _ = vision_tower(model)
    return [n for n, _ in model.named_parameters() if n.startswith(name + ".")]


def count_vision_parameters(model: Any) -> int:
    """Parameters of the vision tower (works on the meta device, for the memory plan)."""
    return sum(p.numel() for p in vision_tower(model)[1].parameters())


def set_vision_trainable(model: Any, trainable: bool) -> int:
    """Freeze (`False`) or unfreeze the vision tower; returns how many parameters it holds. The language model
    and the projector after the tower's merger are untouched (the merger belongs to the tower)."""
    _, tower = vision_tower(model)
    tower.requires_grad_(trainable)
    return sum(p.numel() for p in tower.parameters())


# ---------------------------------------------------------------------------------------- rotary positions


def _rope_owner(model: Any) -> Any:
    for module in _unwrap(model).modules():
        if callable(getattr(module, "get_rope_index", None)):
            return module
    raise ModelError(f"{type(_unwrap(model)).__name__} has no get_rope_index: it does not use multimodal rotary "
                     "positions. Fix: use plain 1-D positions for it (this helper is for Qwen2-VL-style models).")


def mm_token_type_ids(model_or_config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """0 for text, 1 for image tokens, 2 for video tokens (what the processor returns as `mm_token_type_ids`)."""
    ids = vision_token_ids(model_or_config)
    types = torch.zeros_like(input_ids, dtype=torch.int)
    if "image_token_id" in ids:
        types[input_ids == ids["image_token_id"]] = 1
    if "video_token_id" in ids:
        types[input_ids == ids["video_token_id"]] = 2
    return types


def mrope_position_ids(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       image_grid_thw: torch.Tensor | None = None, *, video_grid_thw: torch.Tensor | None = None,
                       token_types: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [3, B, T], rope_deltas [B, 1]) from the model's own `get_rope_index`: text tokens count up
    by one, an image's tokens take (t, h, w) grid positions and the text after it continues past the grid's
    largest side. Pad positions (attention_mask 0) are 0. Pass `position_ids` to the forward explicitly:
    without them (and without `mm_token_type_ids`) transformers falls back to plain 1-D positions, or to
    `rope_deltas` cached on the model by an earlier call. `rope_deltas` continue the positions while decoding
    (`mrope_decode_position_ids`)."""
    owner = _rope_owner(model)
    kwargs: dict[str, Any] = {"image_grid_thw": image_grid_thw, "video_grid_thw": video_grid_thw,
                              "attention_mask": attention_mask}
    if "mm_token_type_ids" in inspect.signature(owner.get_rope_index).parameters:
        types = token_types if token_types is not None else mm_token_type_ids(owner, input_ids)
        kwargs["mm_token_type_ids"] = types.to(input_ids.device)
    with torch.no_grad():
        position_ids, deltas = owner.get_rope_index(input_ids, **kwargs)
    return position_ids, deltas.reshape(-1, 1)


def mrope_decode_position_ids(rope_deltas: torch.Tensor, text_positions: torch.Tensor) -> torch.Tensor:
    """[3, B, n] positions of n new text tokens after a prefill: `text_positions` [B, n] are their plain 1-D
    positions (the number of non-pad tokens before each), shifted by the prefill's `rope_deltas` [B, 1], as
    transformers' generate does; all three rotary sections get the same value for text."""
    positions = text_positions + rope_deltas.to(text_positions.device)
    return positions.unsqueeze(0).expand(3, -1, -1)


__all__ = ["IMAGE_PLACEHOLDER", "QWEN_VISION_TOKENS", "batch_processor_inputs", "cat_image_rows",
           "count_vision_parameters", "image_only_processor_class", "image_processor_sizes", "is_vision_language",
           "load_processor", "mm_token_type_ids", "mrope_decode_position_ids", "mrope_position_ids",
           "num_image_tokens", "processor_inputs", "render_vision_prompt", "set_vision_trainable",
           "split_images_by_row", "unsampled_token_ids", "vision_messages", "vision_parameter_names",
           "vision_token_ids", "vision_tower"]
