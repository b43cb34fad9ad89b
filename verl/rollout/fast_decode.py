"""A lean one-token decode step for Llama-style decoders (Llama, Qwen2, Qwen3, Mistral).

On small models most of the time of a Hugging Face forward is Python: decorators, output
dataclasses, mask creation, per-call rotary embeddings. A rollout calls the model once per token,
so that overhead is paid ``max_new_tokens`` times. This step walks the same modules in the same
order (``input_layernorm``, ``q/k/v_proj``, rotary, attention, ``o_proj``, ``post_attention_layernorm``,
``mlp``, ``norm``, ``lm_head``) as the model's own ``forward``, with the glue inlined: the rotary cos/sin
come from a table built once per rollout, K/V are written in place into the preallocated cache, and the
attention mask is the rollout's additive mask, built once per rollout.

Where the modules are plain (``nn.Linear``, an RMSNorm that ``F.rms_norm`` reproduces bit for bit),
their weights are laid out for decoding once and reused by every rollout until a weight changes:
q/k/v and gate/up concatenated into one matmul each, and on CPU in float32 every projection
(``lm_head`` included) kept as a contiguous [in, out] copy for a plain ``mm``, or, for layers that
``trainer.cpu_matmul`` put on oneDNN, as [out, in] for oneDNN's linear (see :class:`_Linear`).
Anything else (LoRA, quantised layers, another norm) is called as the module it is.

On a small model a decode step is a few dozen ops each costing more than its arithmetic, so on CPU
the step also cuts the op count: ``o_proj`` and ``down_proj`` add into the residual inside their
``addmm`` and RMS norms run as one layer-norm kernel (:class:`_RMSNormAsLayerNorm`). Each agrees with
what it replaces to float32 rounding.

The prefill always runs through the model's own ``forward``. :func:`LlamaStyleDecodeStep.supports`
says whether a model qualifies; anything unusual (sliding windows, dynamic rotary scaling, module
hooks other than FSDP2's, weights still sharded, an unknown architecture) keeps the plain ``forward``
path. An FSDP2 model qualifies while its weights are gathered for the rollout (``fsdp.gathered``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from verl.utils.cpu_matmul import CpuMatmul, DecodeLayout, OneDNNLinear, resolve_decode

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# The decode layout copies the weights (fused and transposed, plus a copy to check them against: about 2x
# the parameters; oneDNN layers keep fused and packed copies, up to 3x). That pays off on small models,
# where each kernel launch costs more than its math, and would waste gigabytes on large ones, which are
# compute-bound anyway; above this many bytes of parameters the projections run as they are.
MAX_FUSED_BYTES = 256 * 2**20
_DYNAMIC_ROPE = ("dynamic", "longrope")
# Weights of oneDNN layers (trainer.cpu_matmul) this large decode on oneDNN's packed layout; smaller ones as
# `mm` on a transposed copy, faster there (16 rows, AMD EPYC: packed 0.82x the time of `mm` at 256 x 256,
# 1.2x-5x slower under 64 x 768; benchmarks/decode_matmul.py).
MIN_PACKED_ELEMENTS = 2**16


@dataclass
class _Linear:
    """One projection in decode layout, multiplied the way the modules' class asks (``kernel``):

    * ``"mm"``: ``x @ weight`` with ``weight`` [in, out] contiguous (CPU, float32, plain ``nn.Linear``). On
      CPU, MKL multiplies a few rows by a plain [in, out] matrix ~1.7x faster than ``F.linear`` does with the
      module's [out, in] weight as a transposed operand, and faster than oneDNN's prepacked linear on Intel
      processors (``benchmarks/decode_matmul.py``; figures in docs/performance.md);
    * ``"onednn"``: the modules are :class:`~verl.utils.cpu_matmul.OneDNNLinear` (``trainer.cpu_matmul``)
      with at least ``MIN_PACKED_ELEMENTS`` weights:
      ``weight`` [out, in], and ``packed``, the same weight in oneDNN's blocked layout (packed once per
      weight change instead of by oneDNN on every call: ~0.7x the time of multiplying the plain weight
      at a decode step's row count, ``benchmarks/decode_matmul.py``);
    * ``"linear"``: ``F.linear(x, weight)`` with ``weight`` [out, in] (other devices and dtypes).

    The sums are ordered differently from the modules' own call, so results differ by float32 rounding,
    as between batch sizes.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    kernel: str
    sources: tuple[torch.nn.Linear, ...] = ()  # the modules whose weights it holds, in output order
    packed: torch.Tensor | None = None  # kernel "onednn": `weight` in oneDNN's layout

    def __post_init__(self) -> None:
        self._pack()

    def _pack(self) -> None:
        if self.kernel == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "mm":
            return torch.mm(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)
        if self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, with the sum inside the product's kernel where it has one."""
        if self.bias is None and self.kernel == "mm":
            return torch.addmm(residual, x, self.weight)
        if self.bias is None and self.kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, None, "add")
        return residual + self(x)

    def refresh(self) -> None:
        """Rewrite the layout from the modules' current weights in place: one pass, no new buffers (but for
        oneDNN's packed copy, which its reorder writes anew)."""
        start = 0
        for module in self.sources:
            rows = slice(start, start + module.weight.shape[0])
            start = rows.stop
            if self.kernel == "mm":
                self.weight[:, rows].copy_(module.weight.detach().t())
            elif self.weight is not module.weight:
                self.weight[rows].copy_(module.weight.detach())
            if self.bias is not None and self.bias is not module.bias:
                self.bias[rows].copy_(module.bias.detach())
        self._pack()


_PLAIN_LINEARS = {torch.nn.Linear: "mm", OneDNNLinear: "onednn"}


def _decode_linear(modules: list[Any], packed: bool = False) -> _Linear | None:
    """The concatenation of plain linear modules of one class in decode layout, or None if any is not plain.
    `packed`: plain `nn.Linear` layers take oneDNN's packed layout too (the decode step's own measured choice)."""
    kinds = {_PLAIN_LINEARS.get(type(m)) for m in modules}
    if None in kinds or len(kinds) != 1:
        return None
    has_bias = [m.bias is not None for m in modules]
    if any(has_bias) and not all(has_bias):
        return None
    weight = torch.cat([m.weight for m in modules], dim=0) if len(modules) > 1 else modules[0].weight
    bias = (torch.cat([m.bias for m in modules], dim=0) if len(modules) > 1 else modules[0].bias) \
        if all(has_bias) else None
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return _Linear(weight, bias, kernel="linear", sources=tuple(modules))
    # oneDNN's fixed cost per call exceeds a small weight's arithmetic: those take MKL's `mm` either way.
    onednn = kinds.pop() == "onednn" or packed
    kernel = "onednn" if onednn and weight.numel() >= MIN_PACKED_ELEMENTS else "mm"
    if kernel == "mm":
        weight = weight.detach().t().contiguous()
    return _Linear(weight.detach() if len(modules) > 1 else weight, bias, kernel=kernel, sources=tuple(modules))


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device and a.shape == b.shape


_RMS_NORM_OK: dict[tuple[type, torch.dtype], bool] = {}


class _RMSNormAsLayerNorm:
    """``F.rms_norm(x, weight)`` computed as ``layer_norm([x, -x])``'s first half, for CPU float32.

    ``[x, -x]`` has mean 0 and variance mean(x^2), so layer norm's one native kernel gives the RMS norm;
    on CPU ``F.rms_norm`` runs as ~10 separate small ops, which is most of its cost on a decode step's
    [rows, hidden] input. The result differs from ``F.rms_norm`` by float32 rounding (the mean is 0 up to
    rounding). The weight is copied (zeros for the second half): the decode layout is rebuilt whenever a
    parameter changes.
    """

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.size = weight.shape[0]
        self.source = weight
        self.weight = torch.cat([weight.detach(), torch.zeros_like(weight)])
        self.eps = eps

    def refresh(self) -> None:
        self.weight[: self.size].copy_(self.source.detach())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        doubled = torch.cat((x, x.neg()), dim=-1)
        return F.layer_norm(doubled, (2 * self.size,), self.weight, None, self.eps)[..., : self.size]


def _rms_norm(module: torch.nn.Module, dtype: torch.dtype) -> Any:
    """The module's RMS norm as one fast call where ``F.rms_norm`` computes the module's bits, else the module.

    Probed once per norm class and dtype (a Gemma-style ``1 + weight`` norm or an upcast that rounds
    differently keeps the module). On CPU in float32 the norm runs as :class:`_RMSNormAsLayerNorm`.
    """
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or not isinstance(eps, float):
        return module
    shape = (weight.shape[0],)
    key = (type(module), dtype)
    if key not in _RMS_NORM_OK:
        probe = torch.randn(8, shape[0], generator=torch.Generator().manual_seed(0)).to(weight.device, dtype) * 3
        _RMS_NORM_OK[key] = torch.equal(module(probe), F.rms_norm(probe, shape, weight, eps))
    if not _RMS_NORM_OK[key]:
        return module
    if weight.device.type == "cpu" and dtype == torch.float32:
        return _RMSNormAsLayerNorm(weight, eps)
    return lambda x: F.rms_norm(x, shape, weight, eps)


def _in_place_silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x, inplace=True)


def _activation(module: Any) -> Any:
    """The MLP's activation as an in-place ``F.silu`` where it computes SiLU's bits (probed when the layout is
    built): it overwrites the gate/up output the step owns instead of allocating. Others run as they are."""
    probe = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)) * 4
    try:
        same = isinstance(module, torch.nn.Module) and torch.equal(module(probe), F.silu(probe))
    except Exception:  # an activation that cannot take the probe keeps its own call
        same = False
    return _in_place_silu if same else module


def _add_projection(projection: Any, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``residual + projection(x)``: in one kernel where the projection is in decode layout and has one."""
    if isinstance(projection, _Linear):
        return projection.add_to(residual, x)
    return residual + projection(x)


@dataclass
class _LayerPlan:
    """One decoder layer's decode-step callables, resolved once per layout (no attribute walks per token)."""

    attn: Any
    mlp: Any
    head_dim: int
    kv_heads: int
    in_norm: Any
    post_norm: Any
    qkv: _Linear | None
    o: Any
    gate_up: _Linear | None
    down: Any
    act_fn: Any


class LlamaStyleDecodeStep:
    """Runs one decode step of a supported model against a rollout cache (see ``hf_engine``).

    One instance serves the rollouts of one engine. :meth:`prepare` reuses the decode layout of the
    weights only while every parameter still holds exactly the values it was built from (compared
    with a copy, not by version counters: fused AdamW updates parameters without bumping them), so a
    rollout after an optimizer step or a weight sync always runs on the new weights.
    """

    def __init__(self, model: torch.nn.Module, cpu_matmul: CpuMatmul = "aten") -> None:
        self.model = model
        # The library plain layers decode with on CPU in float32 (`trainer.cpu_matmul`: `onednn` layers are
        # OneDNNLinear and decode packed whatever this says); `auto` (None until measured) decides on the
        # first layout, by timing this model's decode step at that rollout's rows, and keeps its choice.
        self.kernel: str | None = None if cpu_matmul == "auto" else cpu_matmul
        self.kernel_why = "as set"
        self.base = model.model
        self.layers = list(self.base.layers[: model.config.num_hidden_layers])
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None
        self._built_from: tuple[torch.dtype, list[torch.Tensor], list[torch.Tensor]] | None = None

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
        if any(isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()) for p in model.parameters()):
            return False, "the weights are split by tensor parallelism (the step reads whole weights)"
        if any(isinstance(p, DTensor) for p in model.parameters()):
            return False, ("the weights are sharded (FSDP2); gather them for the rollout "
                           "(verl.distributed.fsdp.gathered)")
        for module in model.modules():
            # FSDP2's hooks gather weights before a forward and free them after; gathered, they have
            # nothing to do for a step that reads the weights directly.
            if not isinstance(module, FSDPModule) and (module._forward_hooks or module._forward_pre_hooks):
                return False, f"{type(module).__name__} has forward hooks that must run"
        return True, ""

    def prepare(self, max_positions: int, device: torch.device, dtype: torch.dtype, rows: int = 16) -> None:
        """Per-rollout set-up: the rotary table, and the decode layout of the weights unless still valid
        (`rows`: the rollout's, which an `auto` choice of the decode's library is measured at).

        The rotary table comes from the model's own rotary module for positions 0..max_positions-1.
        ``rotate_half(x) * sin`` is rewritten as ``swap_halves(x) * signed_sin`` (a sign flip is exact).
        """
        positions = torch.arange(max_positions, device=device).unsqueeze(0)
        probe = torch.zeros(1, 1, 1, device=device, dtype=dtype)
        cos, sin = self.base.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0], sin[0]  # [max_positions, head_dim]
        half = self.cos.shape[-1] // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(device=device, dtype=self.sin.dtype)
        self.signed_sin = self.sin * sign
        params = list(self.model.parameters())
        if self._built_from is not None and self._same_parameters(params, dtype):
            values = self._built_from[2]
            if all(torch.equal(p, v) for p, v in zip(params, values, strict=True)):
                return
            # New values in the same parameters (an optimizer step, a weight sync): rewrite the layout in
            # place, which costs one pass over the weights instead of fresh concatenated copies.
            self._copy_values(params)
            for part in self._layout_parts():
                part.refresh()
            return
        plain = sum(p.numel() * p.element_size() for p in params) <= MAX_FUSED_BYTES
        self._build(plain, dtype, packed=self.kernel == "onednn")
        if plain and self.kernel is None:  # the first layout under `auto`: measure the decode step, once
            layout = self.decode_layout()
            packed = any(p.kernel == "onednn" for p in self._layout_parts() if isinstance(p, _Linear))
            self.kernel, self.kernel_why = (resolve_decode("auto", rows, layout) if layout or not packed
                                            else ("onednn", "the layers are oneDNN's (trainer.cpu_matmul)"))
            if self.kernel == "onednn" and layout:
                self._build(plain, dtype, packed=True)
        # Only small models get a layout (and so a copy to check it against); large ones rebuild for free.
        self._built_from = (dtype, params, self._copy_values(params)) if plain else None

    def _build(self, plain: bool, dtype: torch.dtype, packed: bool) -> None:
        """The per-layer plans and the decode layout of the weights (`packed`: oneDNN's, for plain layers too)."""
        self.plans: list[_LayerPlan] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            mlp_plain = plain and all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn"))
            self.plans.append(_LayerPlan(
                attn=attn, mlp=mlp, head_dim=attn.head_dim, kv_heads=attn.k_proj.weight.shape[0] // attn.head_dim,
                in_norm=_rms_norm(layer.input_layernorm, dtype),
                post_norm=_rms_norm(layer.post_attention_layernorm, dtype),
                qkv=(_decode_linear([attn.q_proj, attn.k_proj, attn.v_proj], packed)
                     if plain and not hasattr(attn, "q_norm") else None),
                o=(_decode_linear([attn.o_proj], packed) if plain else None) or attn.o_proj,
                gate_up=_decode_linear([mlp.gate_proj, mlp.up_proj], packed) if mlp_plain else None,
                down=((_decode_linear([mlp.down_proj], packed) if mlp_plain else None)
                      or getattr(mlp, "down_proj", None)),
                act_fn=_activation(mlp.act_fn) if mlp_plain else None))
        embed = self.base.embed_tokens  # the plain lookup without nn.Module's call overhead, once per token
        self.embed = ((lambda ids: F.embedding(ids, embed.weight)) if type(embed) is torch.nn.Embedding
                      and embed.max_norm is None else embed)
        self.final_norm = _rms_norm(self.base.norm, dtype)
        self.lm_head = (_decode_linear([self.model.lm_head], packed) if plain else None) or self.model.lm_head

    def decode_layout(self) -> DecodeLayout:
        """(in, out) of each `mm` projection of the layout large enough for oneDNN, in the order a step runs them:
        what `trainer.cpu_matmul=auto` times for the decode (`verl.utils.cpu_matmul.resolve_decode`)."""
        parts = [part for plan in self.plans for part in (plan.qkv, plan.o, plan.gate_up, plan.down)] + [self.lm_head]
        return tuple((int(p.weight.shape[0]), int(p.weight.shape[1])) for p in parts
                     if isinstance(p, _Linear) and p.kernel == "mm" and p.weight.numel() >= MIN_PACKED_ELEMENTS)

    def _copy_values(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters' values, written into the previous copy where it fits (no fresh pages to fault in)."""
        old = self._built_from[2] if self._built_from is not None else []
        if len(old) == len(params) and all(_same_layout(p, v) for p, v in zip(params, old, strict=True)):
            for p, v in zip(params, old, strict=True):
                v.copy_(p)
            return old
        return [p.detach().clone() for p in params]

    def _same_parameters(self, params: list[torch.Tensor], dtype: torch.dtype) -> bool:
        """Whether the layout was built from these very parameter tensors (same dtype, shapes and device)."""
        built_dtype, built_params, values = self._built_from
        return (built_dtype == dtype and len(built_params) == len(params)
                and all(a is b for a, b in zip(built_params, params, strict=True))
                and all(_same_layout(p, v) for p, v in zip(params, values, strict=True)))

    def _layout_parts(self) -> list[_Linear | _RMSNormAsLayerNorm]:
        """The pieces of the layout that hold copies of weights (the rest reads the modules directly)."""
        parts = [self.final_norm, self.lm_head]
        for plan in self.plans:
            parts += [plan.in_norm, plan.post_norm, plan.qkv, plan.o, plan.gate_up, plan.down]
        return [p for p in parts if isinstance(p, (_Linear, _RMSNormAsLayerNorm))]

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([x2, x1], dim=-1) * sin

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        """Logits [A, V] for the next token after ``tokens`` [A] at ``positions`` [A].

        ``mask`` is a [A, 1, 1, kv_len] mask of the keys each row may attend to (boolean, or additive: 0
        and -inf), kv_len being the cache length after this step. Hidden states are [A, H] (one token per
        row); attention tensors are [A, kv_heads, group, D], which folds the query heads sharing a KV head
        into sdpa's query axis without repeating K/V.
        """
        rows = tokens.shape[0]
        hidden = self.embed(tokens)  # [A, H]
        cos = self.cos[positions].unsqueeze(1)  # [A, 1, D]
        sin = self.signed_sin[positions].unsqueeze(1)
        for plan, cache_layer in zip(self.plans, cache.layers, strict=True):
            attn, head_dim, kv_heads = plan.attn, plan.head_dim, plan.kv_heads
            x = plan.in_norm(hidden)
            if plan.qkv is not None:
                states = plan.qkv(x).view(rows, -1, head_dim)
                q_heads = states.shape[1] - 2 * kv_heads
                qk = self._rope(states[:, : q_heads + kv_heads], cos, sin)
                q, k = qk[:, :q_heads], qk[:, q_heads:]
                v = states[:, q_heads + kv_heads:]
            else:
                q = attn.q_proj(x).view(rows, -1, head_dim)
                k = attn.k_proj(x).view(rows, -1, head_dim)
                v = attn.v_proj(x).view(rows, -1, head_dim)
                if hasattr(attn, "q_norm"):
                    q, k = attn.q_norm(q), attn.k_norm(k)
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            keys, values = cache_layer.update(k.unsqueeze(2), v.unsqueeze(2))
            q = q.reshape(rows, kv_heads, -1, head_dim)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scaling)
            hidden = _add_projection(plan.o, hidden, out.reshape(rows, -1))  # new: the embedding stays untouched
            x = plan.post_norm(hidden)
            if plan.gate_up is not None:
                gate, up = plan.gate_up(x).chunk(2, dim=-1)
                hidden = _add_projection(plan.down, hidden, plan.act_fn(gate).mul_(up))
            else:
                hidden = hidden + plan.mlp(x)
        return self.lm_head(self.final_norm(hidden))


__all__ = ["LlamaStyleDecodeStep", "SUPPORTED_MODEL_TYPES", "MAX_FUSED_BYTES"]
