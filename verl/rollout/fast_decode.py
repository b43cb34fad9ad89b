"""A lean one-token decode step for Llama-style decoders (Llama, Qwen2, Qwen3, Mistral).

On small models most of the time of a Hugging Face forward is Python: decorators, output
dataclasses, mask creation, per-call rotary embeddings. A rollout calls the model once per token,
so that overhead is paid ``max_new_tokens`` times. This step walks the same modules in the same
order (``input_layernorm``, ``q/k/v_proj``, rotary, attention, ``o_proj``, ``post_attention_layernorm``,
``mlp``, ``norm``, ``lm_head``), calling the model's own submodules so that their numerics, LoRA
wrappers and dtypes are kept, and only inlines the glue: the rotary cos/sin come from a table built
once per rollout, K/V are written in place into the preallocated cache, and the attention mask is
the rollout's ready boolean mask.

The prefill always runs through the model's own ``forward``. :func:`LlamaStyleDecodeStep.supports`
says whether a model qualifies; anything unusual (sliding windows, dynamic rotary scaling, module
hooks such as FSDP's, an unknown architecture) keeps the plain ``forward`` path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_DYNAMIC_ROPE = ("dynamic", "longrope")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaStyleDecodeStep:
    """Runs one decode step of a supported model against a rollout cache (see ``hf_engine``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.base = model.model
        self.layers = list(self.base.layers[: model.config.num_hidden_layers])
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    @staticmethod
    def supports(model: torch.nn.Module) -> tuple[bool, str]:
        """Whether the fast step reproduces ``model.forward`` for this model, and if not, why."""
        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            return False, f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
        base = getattr(model, "model", None)
        for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(base, name):
                return False, f"model.model has no {name}"
        if not hasattr(model, "lm_head"):
            return False, "model has no lm_head"
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            return False, "the model has sliding-window or linear-attention layers"
        if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
            return False, "the model uses a sliding window"
        rope_type = getattr(base.rotary_emb, "rope_type", "default")
        if not isinstance(rope_type, str) or rope_type in _DYNAMIC_ROPE:
            return False, f"rotary type {rope_type!r} depends on the sequence length"
        for layer in base.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None or not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "head_dim", "scaling")):
                return False, "a decoder layer does not have the Llama attention layout"
            if not all(hasattr(layer, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp")):
                return False, "a decoder layer does not have the Llama block layout"
        for module in model.modules():
            if module._forward_hooks or module._forward_pre_hooks:
                return False, f"{type(module).__name__} has forward hooks (e.g. FSDP) that must run"
        return True, ""

    def prepare(self, max_positions: int, device: torch.device, dtype: torch.dtype) -> None:
        """Build the rotary table for positions 0..max_positions-1 with the model's own rotary module."""
        positions = torch.arange(max_positions, device=device).unsqueeze(0)
        probe = torch.zeros(1, 1, 1, device=device, dtype=dtype)
        cos, sin = self.base.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0], sin[0]  # [max_positions, head_dim]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits [A, V] for the next token after ``tokens`` [A] at ``positions`` [A].

        ``mask`` is a boolean [A, 1, 1, kv_len] mask of the keys each row may attend to, kv_len being
        the cache length after this step.
        """
        rows = tokens.shape[0]
        hidden = self.base.embed_tokens(tokens.unsqueeze(-1))  # [A, 1, H]
        cos = self.cos[positions].unsqueeze(1).unsqueeze(1)  # [A, 1, 1, D]
        sin = self.sin[positions].unsqueeze(1).unsqueeze(1)
        for layer, cache_layer in zip(self.layers, cache.layers):
            attn = layer.self_attn
            head_dim = attn.head_dim
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(rows, 1, -1, head_dim)
            k = attn.k_proj(x).view(rows, 1, -1, head_dim)
            v = attn.v_proj(x).view(rows, 1, -1, head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [A, heads, 1, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = cache_layer.update(k, v)
            kv_heads = keys.shape[1]
            # One query token: fold the query heads that share a KV head into the query-length axis,
            # so attention runs on the KV heads without repeating them.
            q = q.reshape(rows, kv_heads, -1, head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
            hidden = hidden + attn.o_proj(out.reshape(rows, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = self.base.norm(hidden)
        return self.model.lm_head(hidden[:, -1, :])


__all__ = ["LlamaStyleDecodeStep", "SUPPORTED_MODEL_TYPES"]
