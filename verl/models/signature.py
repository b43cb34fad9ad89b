"""What a model's forward takes, read from its signature: `logits_to_keep`, a KV cache, `use_cache`.

The forwards of the trainers pass these only to models that declare them. A peft wrapper's or an
`AdapterOff` reference's forward takes **kwargs and hands them to the Hugging Face model under it, so the
question is asked of that model (`base_of`); a `ValueModel` answers for its backbone.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import nn

from verl.models.lora import AdapterOff, base_of, is_peft_model


@functools.cache
def accepts(model_type: type, name: str) -> bool:
    """Whether the model class's forward takes `name` (asked once per class: this is the RL hot path)."""
    try:
        return name in inspect.signature(model_type.forward).parameters
    except (TypeError, ValueError):
        return False


def forward_accepts(model: nn.Module, name: str) -> bool:
    """Whether `model(...)` can be given `name`: asked of the model under a peft wrapper or `AdapterOff`."""
    return accepts(type(base_of(model)), name)


@functools.cache
def _takes_positions(model_type: type) -> bool:
    try:
        param = inspect.signature(model_type.forward).parameters.get("logits_to_keep")
    except (TypeError, ValueError):
        return False
    return param is not None and "Tensor" in str(param.annotation)


def keeps_positions(model: nn.Module) -> bool:
    """Whether `logits_to_keep` also takes a tensor of positions (transformers' `int | Tensor`), not only a
    count of last positions: then the head runs on exactly the positions whose logits are used."""
    return _takes_positions(type(base_of(model)))


def cache_argument(model: nn.Module) -> str | None:
    """The name under which `model(...)` takes a KV cache: `cache` (transformers >= 5.2x) or `past_key_values`
    (before); None if it takes none."""
    for name in ("cache", "past_key_values"):
        if forward_accepts(model, name):
            return name
    return None


def takes_cache(model: nn.Module) -> bool:
    """Whether `model(..., use_cache=True)` returns a KV cache that a later call can continue from."""
    own = getattr(base_of(model), "takes_cache", None)  # a ValueModel asks its backbone
    if callable(own):
        return bool(own())
    return (cache_argument(model) is not None and forward_accepts(model, "use_cache")
            and not prompt_learning(model))


def prompt_learning(model: nn.Module) -> bool:
    """A peft prompt-learning wrapper (prefix tuning, ...) puts its own virtual tokens into the cache and the
    attention mask, so a cache from outside would not line up; LoRA passes the call through unchanged."""
    wrapper = model.policy if isinstance(model, AdapterOff) else model
    config = getattr(wrapper, "active_peft_config", None) if is_peft_model(wrapper) else None
    return bool(getattr(config, "is_prompt_learning", False))


def full_attention_only(config: Any) -> bool:
    """True when every layer of a model with this config attends to the whole past (no sliding window, no linear
    attention): what a prepared full-length mask or a flat KV cache assumes."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or not getattr(config, "use_sliding_window", True)


def returned_cache(output: Any) -> Any:
    """The KV cache of a forward's output (`cache` or, before transformers 5.2x, `past_key_values`)."""
    cache = getattr(output, "cache", None)
    return output.past_key_values if cache is None else cache


__all__ = ["accepts", "cache_argument", "forward_accepts", "full_attention_only", "keeps_positions", "prompt_learning",
           "returned_cache", "takes_cache"]
