"""Routing one model's attention through a function of verl's (sequence parallelism, packed sequences).

transformers looks each attention module's function up by `module.config._attn_implementation` in its
`AttentionInterface` registry. Giving the modules of one model a config copy that names a registered function
reroutes exactly those modules: the model's own config (its masks, generation, `save_pretrained`) and every
other model keep the original. The function runs the original attention (`original_attention`) whenever the
forward does not ask for the rerouted behaviour.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch


def original_attention(module: torch.nn.Module, marker: str) -> Callable[..., Any]:
    """The attention function `module` had before `route_attention(..., marker)` (its modeling file's eager
    one for 'eager')."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(module, marker, None)
    if name in (None, "eager"):
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def route_attention(modules: Sequence[torch.nn.Module], name: str, fn: Callable[..., Any], marker: str) -> None:
    """Register `fn` as `name` and point `modules` at it, remembering each one's function under `marker`
    (idempotent: a module already routed to `name` is left alone)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, fn)
    for m in modules:
        if m.config._attn_implementation == name:
            continue
        setattr(m, marker, m.config._attn_implementation)
        cfg = copy.copy(m.config)  # this module's own: the model's config keeps its attention
        cfg._attn_implementation_internal = name
        m.config = cfg


__all__ = ["original_attention", "route_attention"]
