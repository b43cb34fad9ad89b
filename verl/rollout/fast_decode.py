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
# Fusing q/k/v and gate/up copies those weights for the rollout. That pays off on small models, where
# each kernel launch costs more than its math, and would waste gigabytes on large ones, which are
# compute-bound anyway; above this many bytes of copies the projections run as they are.
MAX_FUSED_BYTES = 256 * 2**20
_DYNAMIC_ROPE = ("dynamic", "longrope")


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
        """Per-rollout set-up: the rotary table and the fused projection weights.

        The rotary table comes from the model's own rotary module for positions 0..max_positions-1.
        ``rotate_half(x) * sin`` is rewritten as ``x[..., perm] * signed_sin`` (a sign flip is exact), one
        gather instead of two slices, a negation and a concat. Where q/k/v (and gate/up) are plain
        ``nn.Linear`` they run as one matmul on concatenated weights; anything else (LoRA, quantised
        layers) is called as the module it is.
        """
        positions = torch.arange(max_positions, device=device).unsqueeze(0)
        probe = torch.zeros(1, 1, 1, device=device, dtype=dtype)
        cos, sin = self.base.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0], sin[0]  # [max_positions, head_dim]
        half = self.cos.shape[-1] // 2
        self.perm = torch.cat([torch.arange(half, 2 * half), torch.arange(half)]).to(device)
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(device=device, dtype=self.sin.dtype)
        self.signed_sin = self.sin * sign
        self.qkv: list[Any] = [None] * len(self.layers)
        self.gate_up: list[Any] = [None] * len(self.layers)
        fused_bytes = sum(
            p.numel() * p.element_size()
            for layer in self.layers
            for module, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                                  (layer.mlp, ("gate_proj", "up_proj")))
            for name in names if hasattr(module, name)
            for p in getattr(module, name).parameters()
        )
        if fused_bytes > MAX_FUSED_BYTES:
            return
        self.qkv = [self._fuse(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
                    if not hasattr(layer.self_attn, "q_norm") else None for layer in self.layers]
        self.gate_up = [self._fuse(layer.mlp, ("gate_proj", "up_proj"))
                        if all(hasattr(layer.mlp, a) for a in ("down_proj", "act_fn")) else None
                        for layer in self.layers]

    @staticmethod
    def _fuse(module: torch.nn.Module, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        linears = [getattr(module, name, None) for name in names]
        if not all(type(lin) is torch.nn.Linear for lin in linears):
            return None
        has_bias = [lin.bias is not None for lin in linears]
        if any(has_bias) and not all(has_bias):
            return None
        weight = torch.cat([lin.weight for lin in linears], dim=0)
        bias = torch.cat([lin.bias for lin in linears], dim=0) if all(has_bias) else None
        return weight, bias

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + x[..., self.perm] * sin

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits [A, V] for the next token after ``tokens`` [A] at ``positions`` [A].

        ``mask`` is a boolean [A, 1, 1, kv_len] mask of the keys each row may attend to, kv_len being
        the cache length after this step. Tensors are laid out [A, 1, heads, D] (one query token), which
        folds the query heads sharing a KV head into sdpa's query axis without repeating K/V.
        """
        rows = tokens.shape[0]
        hidden = self.base.embed_tokens(tokens.unsqueeze(-1))  # [A, 1, H]
        cos = self.cos[positions].unsqueeze(1).unsqueeze(1)  # [A, 1, 1, D]
        sin = self.signed_sin[positions].unsqueeze(1).unsqueeze(1)
        for layer, cache_layer, qkv, gate_up in zip(self.layers, cache.layers, self.qkv, self.gate_up, strict=True):
            attn = layer.self_attn
            head_dim = attn.head_dim
            x = layer.input_layernorm(hidden)
            if qkv is not None:
                heads = qkv[0].shape[0] // head_dim
                kv_heads = attn.k_proj.weight.shape[0] // head_dim
                q_heads = heads - 2 * kv_heads
                states = F.linear(x, *qkv).view(rows, 1, heads, head_dim)
                qk = self._rope(states[:, :, : q_heads + kv_heads], cos, sin)
                q, k = qk[:, :, :q_heads], qk[:, :, q_heads:]
                v = states[:, :, q_heads + kv_heads:]
            else:
                q = attn.q_proj(x).view(rows, 1, -1, head_dim)
                k = attn.k_proj(x).view(rows, 1, -1, head_dim)
                v = attn.v_proj(x).view(rows, 1, -1, head_dim)
                if hasattr(attn, "q_norm"):
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            keys, values = cache_layer.update(k.transpose(1, 2), v.transpose(1, 2))
            q = q.reshape(rows, keys.shape[1], -1, head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
            hidden = hidden + attn.o_proj(out.reshape(rows, 1, -1))
            x = layer.post_attention_layernorm(hidden)
            if gate_up is not None:
                mlp = layer.mlp
                gate, up = F.linear(x, *gate_up).chunk(2, dim=-1)
                hidden = hidden + mlp.down_proj(mlp.act_fn(gate) * up)
            else:
                hidden = hidden + layer.mlp(x)
        hidden = self.base.norm(hidden)
        return self.model.lm_head(hidden[:, -1, :])


__all__ = ["LlamaStyleDecodeStep", "SUPPORTED_MODEL_TYPES", "MAX_FUSED_BYTES"]
