"""Attention over packed sequences one sequence at a time: what flash-attention's varlen kernel does on GPUs,
for the attention implementations that have no such kernel (sdpa, eager; CPUs).

A packed row (`actor.remove_padding`, `verl.trainer.forward.packing`) holds several sequences back to back. Given only
position ids, transformers builds a [T, T] block-diagonal mask and the attention computes all T x T scores, most
of them masked: a packed row of 900 tokens made of 8 sequences costs 4-5x the attention of the sequences alone,
which on a CPU outweighed the padding it saved. With the `verl_packed_lengths` keyword (the sequences' lengths)
this attention instead splits queries, keys and values at the boundaries and runs causal attention on each
sequence (scaled_dot_product_attention with is_causal: its flash kernel on CPUs, no mask at all), so a packed
forward costs the real tokens' projections and each sequence's own attention.

Installed like the sequence-parallel attention, for one model's attention modules only
(`verl.utils.attention_hook`); a forward without the keyword (generation, padded forwards) runs the original
attention. Models whose attention takes
other arguments (soft-capping, sinks, sliding windows) keep transformers' mask path instead.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch

from verl.errors import ConfigError
from verl.models.lora import base_of
from verl.utils.attention_hook import original_attention, route_attention

KWARG = "verl_packed_lengths"  # the forward keyword: the lengths of the packed sequences, in order
ATTENTION_NAME = "verl_varlen"
_MARKER = "_verl_varlen_fallback"  # where a routed module keeps its original attention's name
SUPPORTED_MODEL_TYPES = ("qwen2", "llama")  # q/k/v projections, rotary before the attention call, no extras
NATIVE_VARLEN = ("flash_attention_2", "flash_attention_3")  # read the packed position ids themselves

_READY: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [1, H, T, D], k/v [1, KV, T, D] (rotary applied with each
    sequence's own positions) -> ([1, T, H, D], None). Without the packed-lengths keyword: the original."""
    lengths = kwargs.pop(KWARG, None)
    if lengths is None:
        return original_attention(module, _MARKER)(module, query, key, value, attention_mask, dropout=dropout,
                                                   scaling=scaling, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ConfigError(f"{type(module).__name__} layer {getattr(module, 'layer_idx', '?')} uses sliding-window "
                          "attention, which the packed attention does not implement. Fix: set "
                          "actor.remove_padding=false (and critic.remove_padding) for this model")
    gqa = query.shape[1] != key.shape[1]
    parts = [torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                              scale=scaling, enable_gqa=gqa)
             for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value)), strict=True)]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in base_of(model).modules() if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "config"))]


def _passes_keywords(model_type: type) -> bool:
    try:
        parameters = inspect.signature(model_type.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def varlen_ready(model: torch.nn.Module) -> bool:
    """Whether `model`'s packed forwards take `KWARG` (installing the attention on first call): its attention
    modules are of a supported model type, without sliding windows, and not on a varlen kernel already."""
    if model not in _READY:
        _READY[model] = _install(model)
    return _READY[model]


def _install(model: torch.nn.Module) -> bool:
    if not all(_passes_keywords(type(m)) for m in (model, base_of(model))):
        return False  # a wrapper that names its arguments cannot hand the sequence lengths down
    modules = _attention_modules(model)
    configs = [m.config for m in modules]
    usable = bool(modules) and all(
        getattr(c, "model_type", None) in SUPPORTED_MODEL_TYPES and not getattr(c, "use_sliding_window", False)
        and c._attn_implementation not in NATIVE_VARLEN for c in configs)
    if not usable:
        return False
    route_attention(modules, ATTENTION_NAME, varlen_attention, _MARKER)
    return True


__all__ = ["ATTENTION_NAME", "KWARG", "varlen_attention", "varlen_ready"]
