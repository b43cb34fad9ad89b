"""Tensor parallelism (Megatron-style, on torch's DTensor) for Hugging Face Qwen2 / Qwen3 / Llama causal LMs.

FSDP2 shards a model's *storage* over data-parallel ranks but still runs every matmul whole on each rank; a
model whose layers (or whose [tokens, vocabulary] logits) do not fit one device needs the *compute* split
too. Inside a node, tensor parallelism splits each decoder layer over a group of ranks that all see the same
batch: attention by heads (q/k/v column-wise, o row-wise), the MLP by its intermediate size (gate/up
column-wise, down row-wise), the embedding and the head by the vocabulary. Each layer then costs two
all-reduces forward and two backward, and no rank ever holds a whole layer or the whole logits.

We use torch's own `parallelize_module` styles (no model code of our own), so a TP model is the Hugging Face
module with DTensor parameters: FSDP2 `fully_shard(..., mesh=mesh["dp"])` composes over it on a 2-D
(dp, tp) mesh, and `torch.distributed.checkpoint` saves and loads it. Hugging Face's attention (transformers
>= 4.48) reshapes its projections with ``-1`` heads, so the local projections give it the local heads as they
are; older attention modules that keep ``num_heads`` attributes get them divided (`_localize_attention`).

The head keeps its output sharded over the vocabulary (a DTensor, `Shard(-1)`): `vocab_parallel_logprobs`
computes the log-probs of the labels and the entropy from the shards with a few [tokens]-sized all-reduces,
never gathering [tokens, V].
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from verl.algorithms.logits import _LOGP_FLOOR  # the single-process entropy's floor on log p
from verl.errors import ConfigError

SUPPORTED = ("qwen2", "qwen3", "llama")
_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tensor_parallel(config: Any, tp_size: int) -> None:
    """Raise one `ConfigError` listing every reason a model with this Hugging Face `config` cannot be split
    over `tp_size` ranks (model type, heads, KV heads, intermediate size, vocabulary). Needs no model, so
    `verl check` can call it before anything is loaded."""
    if tp_size < 1:
        raise ConfigError(f"tensor-parallel size {tp_size}: it must be >= 1 (1 turns tensor parallelism off)")
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise ConfigError(f"tensor parallelism supports model types {', '.join(SUPPORTED)}, not {model_type!r}. "
                          "Fix: set the tensor-parallel size to 1 (FSDP alone) for this model")
    heads = config.num_attention_heads
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
    }
    problems = [f"config.{key}={value} is not divisible by the tensor-parallel size {tp_size}"
                for key, value in sizes.items() if value % tp_size]
    if problems:
        common = sorted(set.intersection(*(set(_divisors(v)) for v in sizes.values())))
        raise ConfigError("cannot split the model over tensor-parallel ranks: " + "; ".join(problems) +
                          f". Fix: use a tensor-parallel size that divides all of them ({common}); "
                          "a KV head cannot be split, so the size must divide num_key_value_heads")


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(model, "lm_head"):
        raise ConfigError(f"{type(model).__name__} is not a Hugging Face causal LM with model.layers and lm_head; "
                          f"tensor parallelism supports {', '.join(SUPPORTED)} causal LMs. Fix: set the "
                          "tensor-parallel size to 1 for this model")
    return layers


def tp_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The parallelize plan of a Qwen2/Qwen3/Llama causal LM, by module name: attention and MLP column-wise in,
    row-wise out (one all-reduce each, forward and backward); the embedding row-wise over the vocabulary
    (its output all-reduced: replicated hidden states); the head column-wise with its logits left sharded
    over the vocabulary (a `Shard(-1)` DTensor, for `vocab_parallel_logprobs`)."""
    plan: dict[str, ParallelStyle] = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                                            output_layouts=Replicate())}
    for i, layer in enumerate(_decoder_layers(model)):
        plan |= {f"model.layers.{i}.{name}": ColwiseParallel() for name in _COLWISE}
        plan |= {f"model.layers.{i}.{name}": RowwiseParallel() for name in _ROWWISE}
        # Qwen3 normalizes each head of q and k ([B, T, heads, head_dim]): on local heads, so the norm's
        # weight gradient is a partial sum over the heads; as a replicated DTensor it is summed over the group.
        plan |= {f"model.layers.{i}.self_attn.{name}": SequenceParallel(sequence_dim=2, use_local_output=True)
                 for name in ("q_norm", "k_norm") if hasattr(layer.self_attn, name)}
    plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def _localize_attention(model: nn.Module, tp_size: int) -> None:
    """Divide the head counts an attention module keeps as attributes (older transformers reshape with
    them; 4.48+ reshape with -1 and keep only `head_dim` and the group ratio, which TP leaves unchanged)."""
    for layer in _decoder_layers(model):
        attn = layer.self_attn
        for name in ("num_heads", "num_key_value_heads"):
            if isinstance(getattr(attn, name, None), int):
                setattr(attn, name, getattr(attn, name) // tp_size)


def _tied(model: nn.Module) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split `model` in place over the 1-D `tp_mesh` (every rank of it must call this, with the same weights
    or on the meta device) and return it. Its parameters become DTensors sharded over `tp_mesh` (norms stay
    plain, replicated tensors); build the optimizer after this, and after `fully_shard` if FSDP2 follows.

    Tied embeddings (the tiny models tie) stay tied: the embedding (row-wise) and the head (column-wise) both
    shard the [V, H] weight over its vocabulary rows, so the head gets the embedding's DTensor back."""
    if tp_mesh.ndim != 1:
        raise ConfigError(f"apply_tensor_parallel takes a 1-D mesh, got {tp_mesh.ndim}-D. Fix: pass mesh['tp'] "
                          "of `dp_tp_mesh`")
    tp_size = tp_mesh.size()
    check_tensor_parallel(model.config, tp_size)
    if tp_size == 1:
        return model
    tied = _tied(model)
    parallelize_module(model, tp_mesh, tp_plan(model))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    _localize_attention(model, tp_size)
    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:  # (a frozen reference has no gradients)
            param.register_post_accumulate_grad_hook(_grad_like_param)
    return model


def _grad_like_param(param: DTensor) -> None:
    """Give a gradient its parameter's layout. DTensor's backward leaves some in another one: the embedding's
    replicated (the whole [V, H] on every rank), Qwen3's q/k norms' partial sums over the heads. Optimizers
    and clipping then see each parameter's gradient as its own shard. (Under FSDP2 these hooks sit on the
    parameters it replaces and never run: FSDP2 redistributes the gradients itself before reduce-scattering.)"""
    if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
        param.grad = param.grad.redistribute(param.device_mesh, param.placements)


def dp_tp_mesh(dp: int, tp: int, device_type: str | None = None) -> DeviceMesh:
    """A (dp, tp) mesh over the whole world, tp the inner dimension (consecutive ranks: one node's devices).
    Pass `mesh["tp"]` to `apply_tensor_parallel` and `mesh["dp"]` to FSDP2 (`apply_fsdp(..., mesh=...)`);
    the ranks of one tp group must be given the same batch."""
    world = dist.get_world_size()
    if dp * tp != world:
        raise ConfigError(f"a (dp={dp}, tp={tp}) mesh needs dp * tp = {dp * tp} ranks, but the world has {world}. "
                          f"Fix: choose a tensor-parallel size that divides {world} (dp = world / tp)")
    dev = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    return init_device_mesh(dev, (dp, tp), mesh_dim_names=("dp", "tp"))


def is_tensor_parallel(parameters: Any) -> bool:
    """Whether any of `parameters` is split over a tensor-parallel mesh dimension (`dp_tp_mesh`'s "tp", or a
    1-D mesh of `apply_tensor_parallel` alone)."""
    return any(isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()) for p in parameters)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a TP model; returns the total norm (a plain tensor, the same on
    every rank). Torch's stacks the per-gradient norms, which fails where plain tensors and DTensors meet (TP
    alone: the norms' weights stay plain) or DTensors of two meshes (TP x FSDP2: norms on the dp mesh, the rest
    on (dp, tp)); here each mesh's norm is made whole (`full_tensor`) and the norms combined."""
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    norms = [torch.nn.utils.get_total_norm(group, norm_type) for group in groups.values()]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total = torch.nn.utils.get_total_norm(norms, norm_type) if norms else torch.tensor(0.0)
    coef = float(max_norm) / (float(total) + 1e-6)  # torch's coefficient (a finite norm: the caller checks)
    if coef < 1.0:
        for grad in grads:
            grad.mul_(coef)
    return total


class _SumOverShards(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward (Megatron's reduce-from-TP-region).

    Every rank of the group computes the same (replicated) loss from the sum, and a rank's term enters the
    sum once, so the gradient of its term is the upstream gradient as it is. (`torch.distributed.nn`'s
    all_reduce sums the G identical upstream gradients in backward: G times too large here.)"""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _local_logits(logits: torch.Tensor, tp_group: Any) -> tuple[torch.Tensor, Any]:
    """This rank's [..., V/tp] logits and the group they are sharded over."""
    if not isinstance(logits, DTensor):
        if tp_group is None:
            raise ValueError("vocab_parallel_logprobs got a local tensor without tp_group; pass the group its "
                             "vocabulary is sharded over (or the head's DTensor output)")
        return logits, tp_group
    mesh = logits.device_mesh
    placement = logits.placements[0]
    if mesh.ndim != 1 or not (placement.is_shard() and placement.dim in (-1, logits.dim() - 1)):
        raise ValueError(f"vocab_parallel_logprobs needs logits sharded over the vocabulary on a 1-D mesh "
                         f"(Shard(-1)), got placements {logits.placements} on a {mesh.ndim}-D mesh")
    if logits.shape[-1] % mesh.size():
        raise ValueError(f"vocabulary {logits.shape[-1]} is not divisible by the tensor-parallel size {mesh.size()}")
    return logits.to_local(), tp_group if tp_group is not None else mesh.get_group()


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    tp_group: Any = None,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log softmax(logits / T)[label], entropy of softmax(logits / T)), both [...] in float32 (float64 for
    float64 logits), from logits sharded over the vocabulary: a `Shard(-1)` DTensor (the TP head's output;
    `tp_group` defaults to its mesh's group) or this rank's [..., V/tp] slice with `tp_group`, rank i of the
    group holding vocabulary ids [i * V/tp, (i+1) * V/tp). `labels` [...] are global ids, the same on every
    rank. Never gathers the [..., V] logits: one max and one sum all-reduce of [tokens]- and
    [tokens, 3]-sized tensors. Differentiable; every rank of the group must compute the same loss from the
    results (its gradient then reaches each rank's shard once). Matches `verl.algorithms.token_logprobs` and
    `entropy_from_logits` (upcast, then / T; log p floored for the entropy, so banned -inf logits give 0)."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}; pass a temperature > 0 (1.0 for the logits as they are)")
    local, group = _local_logits(logits, tp_group)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    vocab_local = local.shape[-1]
    if tuple(labels.shape) != tuple(local.shape[:-1]):
        raise ValueError(f"labels have shape {tuple(labels.shape)} but logits {tuple(local.shape)}; labels must "
                         "have the logits' shape without the vocabulary dimension")
    dtype = torch.promote_types(local.dtype, torch.float32)
    x = local.reshape(-1, vocab_local).to(dtype)
    x = x if temperature == 1.0 else x / temperature
    ids = labels.reshape(-1).long()
    if ids.numel() and bool(((ids < 0) | (ids >= vocab_local * size)).any()):
        raise ValueError(f"labels outside the vocabulary [0, {vocab_local * size}); replace ignore ids such as "
                         "-100 with a valid id and mask those positions out")
    with torch.no_grad():  # any shift gives the same result; the max keeps exp() in range
        shift = x.max(dim=-1).values
        dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
        shift = shift.clamp_min(torch.finfo(dtype).min)  # a row of -inf on every shard: no NaN from -inf - -inf
    shifted = x - shift[:, None]
    exp = shifted.exp()
    start = rank * vocab_local
    owned = (ids >= start) & (ids < start + vocab_local)
    picked = shifted.gather(-1, (ids - start).clamp(0, vocab_local - 1)[:, None]).squeeze(-1)
    terms = [exp.sum(-1), torch.where(owned, picked, torch.zeros_like(picked))]
    if with_entropy:  # sum exp(z) * z: with S = sum exp(z), H = log S - (sum exp(z) * z) / S
        terms.append((exp * shifted.clamp_min(_LOGP_FLOOR)).sum(-1))  # a banned -inf logit adds 0, not NaN
    # Every term is a sum over this rank's logits alone, so each rank's term gets the replicated gradient.
    sums = _SumOverShards.apply(torch.stack(terms, -1), group).unbind(-1)
    lse = sums[0].log()  # logsumexp - shift
    logprobs = (sums[1] - lse).reshape(labels.shape)
    if not with_entropy:
        return logprobs, None
    entropy = lse - sums[2] / sums[0]
    return logprobs, entropy.reshape(labels.shape)


__all__ = [
    "SUPPORTED",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "clip_grad_norm_",
    "dp_tp_mesh",
    "is_tensor_parallel",
    "tp_plan",
    "vocab_parallel_logprobs",
]
