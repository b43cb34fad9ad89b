"""Ulysses sequence parallelism: one long sequence split along its tokens over the ranks of a group.

Each of the S ranks of a sequence-parallel group holds T/S of the tokens of every layer's input (every S-th
token: the ranks hold as many response positions, so as many logits, wherever the prompt ends). The
embeddings, MLPs, norms and the head only ever see those local tokens, which is where the activation memory
of a long sequence goes. Attention is the one place that needs the whole sequence: there an all-to-all turns
[B, H, T/S, D] (all heads, my tokens) into [B, H/S, T, D] (my heads, all tokens), put back in row order,
attention runs causally over each sequence, and the output goes back the same way. Both all-to-alls are
autograd functions whose backward is the opposite all-to-all. The forwards split one row of sequences packed
back to back without padding (`verl.trainer.forward.logprobs.SplitRow`), so the attention runs each sequence alone.

The attention function is installed through transformers' `AttentionInterface` registry for the attention
modules of one model only (they get a copy of the config naming it; the model's own config, its masks and the
rollout engine keep the original implementation). It does the all-to-all only when a forward passes the
`verl_sequence_parallel` keyword (which Hugging Face models hand down to their attention functions, and
activation checkpointing hands to the recomputation); any other forward, such as generation, runs the
original attention untouched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl.errors import ConfigError
from verl.utils.attention_hook import original_attention, route_attention

KWARG = "verl_sequence_parallel"  # the forward keyword that switches the attention to the all-to-all path
ATTENTION_NAME = "verl_ulysses"  # its name in transformers' attention registry
_MARKER = "_verl_sp_fallback"  # where a routed module keeps its original attention's name
SUPPORTED_MODEL_TYPES = ("qwen2", "llama")  # attention modules of the q/k/v-projection, rotary, HF-interface kind


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: `size` ranks that split each sequence, this one `index`-th."""

    group: Any
    ranks: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class SplitCall:
    """What a split forward hands its attention (the `KWARG` keyword): the group; the lengths of the
    sequences packed back to back into the row being split (in order, summing to its full width), each of
    which attends causally to itself only; and `order`, the row's tokens in the order the all-to-all gathers
    them (rank by rank: `order[t]` is where token t arrives), with `inverse` undoing it."""

    sp: SequenceParallel
    lengths: tuple[int, ...]
    order: torch.Tensor
    inverse: torch.Tensor


def sequence_parallel_layout(ranks: Sequence[int], size: int) -> list[tuple[int, ...]]:
    """The groups of `size` consecutive ranks of a role (consecutive ranks share a node, where the
    all-to-alls are fastest); the data-parallel replicas are the groups."""
    ranks = tuple(ranks)
    if size < 1 or len(ranks) % size:
        raise ConfigError(f"actor.sequence_parallel_size={size} does not divide the actor's {len(ranks)} rank(s). "
                          f"Fix: use a divisor of {len(ranks)}, or launch a multiple of {size} actor ranks")
    return [ranks[i : i + size] for i in range(0, len(ranks), size)]


def sequence_parallel_problems(size: int, *, actor_ranks: int | None = None, model_type: str | None = None,
                               num_heads: int | None = None, num_kv_heads: int | None = None,
                               sliding_window: bool = False, key: str = "actor.sequence_parallel_size") -> list[str]:
    """Why `size`-way sequence parallelism cannot run (empty: it can). The one check `verl check`, the
    trainer's start-up and `enable_sequence_parallel` share; unknown facts (None) are not checked.

    Query heads must split evenly over the ranks (each gets H/S whole heads). Key/value heads (GQA) need
    not: when S does not divide them, they are repeated up to lcm(KV, S) heads before the all-to-all, which
    costs communication but gives the same attention."""
    if size == 1:
        return []
    problems = []
    if actor_ranks is not None and actor_ranks % size:
        problems.append(f"{key}={size} does not divide the actor's {actor_ranks} rank(s): each sequence-parallel "
                        f"group is {size} actor ranks. Fix: launch a multiple of {size} actor ranks, or use a "
                        f"divisor of {actor_ranks}")
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(f"{key}={size}: sequence parallelism is implemented for the attention of "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)} models, not model_type={model_type!r}. Fix: set "
                        f"{key}=1 for this model")
    if num_heads is not None and num_heads % size:
        divisors = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        problems.append(f"{key}={size} does not divide the model's {num_heads} attention heads: each rank "
                        f"attends with whole heads. Fix: use one of {divisors}")
    if num_heads is not None and num_kv_heads is not None and num_kv_heads and num_heads % num_kv_heads:
        problems.append(f"the model's {num_heads} attention heads are not a multiple of its {num_kv_heads} key/value "
                        "heads; sequence parallelism needs grouped-query attention with whole groups")
    if sliding_window:
        problems.append(f"{key}={size}: the model has sliding-window attention layers, which the sequence-parallel "
                        f"attention does not implement (it is causal over the whole sequence). Fix: set {key}=1, "
                        "or turn the sliding window off (use_sliding_window: false)")
    return problems


def describe_sequence_parallel(size: int, actor_ranks: int, num_heads: int | None = None,
                               num_kv_heads: int | None = None, kind: str = "rl") -> str:
    """What `verl check` says the setting does (`size` > 1, checked) for a `kind` of run."""
    text = (f"sequence parallelism: actor.sequence_parallel_size={size}: {actor_ranks // size} group(s) of {size} "
            "consecutive actor ranks; ")
    if kind == "rl":
        text += ("each group pools its ranks' rows for the actor's log-prob and update forwards; a micro-batch "
                 "(actor.micro_batch_size rows of the pool, or the token budget's real tokens)")
    else:
        text += (f"the ranks of a group read the same rows (data parallelism over the {actor_ranks // size} "
                 "group(s)); a micro-batch")
    text += f" runs as one row of its sequences without padding, split {size} ways (all-to-all over attention heads)"
    if num_heads is not None and num_kv_heads is not None:
        sent = kv_heads_sent(num_kv_heads, size)
        text += f"; {num_heads // size} query head(s) per rank"
        if sent != num_kv_heads:
            text += (f", the {num_kv_heads} key/value head(s) repeated to {sent} so that each rank gets its "
                     f"{sent // size}")
    return text


def kv_heads_sent(num_kv_heads: int, size: int) -> int:
    """Key/value heads after repetition, so that every rank's query heads find theirs among its KV/S."""
    return num_kv_heads if num_kv_heads % size == 0 else math.lcm(num_kv_heads, size)


# ---------------------------------------------------------------------- autograd collectives
def _seq_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[B, H, C, D] (all heads, my C tokens) -> [B, H/S, S*C, D] (my heads, every token in order)."""
    b, h, c, d = x.shape
    s = sp.size
    send = x.reshape(b, s, h // s, c, d).transpose(0, 1).contiguous()  # chunk j: rank j's heads
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=sp.group)  # got[r]: rank r's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // s, s * c, d)


def _heads_to_seq(y: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[B, H/S, S*C, D] (my heads, every token) -> [B, H, C, D] (all heads, my tokens): `_seq_to_heads`^-1."""
    b, hs, t, d = y.shape
    s = sp.size
    send = y.reshape(b, hs, s, t // s, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk r: rank r's tokens
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=sp.group)  # got[j]: rank j's heads of my tokens
    return got.transpose(0, 1).reshape(b, hs * s, t // s, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        ctx.sp = sp
        return _seq_to_heads(x, sp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad, ctx.sp), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        ctx.sp = sp
        return _heads_to_seq(y, sp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad, ctx.sp), None


def seq_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Sequence-sharded to head-sharded ([B, H, T/S, D] -> [B, H/S, T, D]); backward is the reverse."""
    return _SeqToHeads.apply(x, sp)


def heads_to_seq(y: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Head-sharded to sequence-sharded ([B, H/S, T, D] -> [B, H, T/S, D]); backward is the reverse."""
    return _HeadsToSeq.apply(y, sp)


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        ctx.sp, ctx.width = sp, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start = ctx.sp.index * ctx.width
        return grad[:, start : start + ctx.width].contiguous(), None


def gather_sequence(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Every rank's [B, C, ...] piece along dim 1, in rank order: [B, S*C, ...] on every rank.

    For a result every rank of the group then consumes identically (the same loss of the same rows): the
    backward keeps this rank's slice of the gradient, not a sum over ranks, so the S copies of the loss
    count once, and each rank's parameters get the gradient through its own tokens."""
    if sp.size == 1:
        return x
    return _GatherReplicated.apply(x, sp)


# ---------------------------------------------------------------------- the attention function
def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [1, H, C, D], k/v [1, KV, C, D] (rotary applied with the
    packed sequences' own positions) -> ([1, C, H, D], None). Without the sequence-parallel keyword (a
    `SplitCall`): the original.

    With it, the row holds sequences packed back to back (no padding but a tail of its own): after the
    all-to-all each rank has every token of its heads, and each sequence attends causally to itself
    (scaled_dot_product_attention per sequence, no mask), as the padded forward's masked attention gives it."""
    call = kwargs.pop(KWARG, None)
    if call is None:
        return original_attention(module, _MARKER)(module, query, key, value, attention_mask, dropout=dropout,
                                                   scaling=scaling, **kwargs)
    sp = call.sp
    if kwargs.get("sliding_window") is not None:
        raise ConfigError(f"{type(module).__name__} layer {getattr(module, 'layer_idx', '?')} uses sliding-window "
                          "attention, which the sequence-parallel attention does not implement. Fix: set "
                          "actor.sequence_parallel_size=1 for this model")
    kv = key.shape[1]
    sent = kv_heads_sent(kv, sp.size)
    if sent != kv:  # GQA with fewer (or indivisible) key/value heads: repeat each up to lcm(KV, S)
        key, value = (t.repeat_interleave(sent // kv, dim=1) for t in (key, value))
    q, k, v = (seq_to_heads(t, sp).index_select(2, call.order) for t in (query, key, value))  # in row order
    gqa = q.shape[1] != k.shape[1]
    parts = [torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, dropout_p=dropout, is_causal=True,
                                                              scale=scaling, enable_gqa=gqa)
             for qi, ki, vi in zip(*(t.split(call.lengths, dim=2) for t in (q, k, v)), strict=True)]
    out = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)).index_select(2, call.inverse)
    return heads_to_seq(out, sp).transpose(1, 2).contiguous(), None


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "config"))]


def model_facts(config: Any) -> dict[str, Any]:
    """What `sequence_parallel_problems` reads off a Hugging Face config (text config of a multimodal one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    layer_types = getattr(text, "layer_types", None) or []
    sliding = "sliding_attention" in layer_types or (bool(getattr(text, "use_sliding_window", False))
                                                     and getattr(text, "sliding_window", None) is not None
                                                     and not layer_types)
    return {"model_type": getattr(text, "model_type", None), "num_heads": heads,
            "num_kv_heads": getattr(text, "num_key_value_heads", None) or heads, "sliding_window": sliding}


def enable_sequence_parallel(model: torch.nn.Module, size: int) -> int:
    """Route `model`'s attention through `ulysses_attention` (idempotent); returns the attention modules
    changed. Raises a ConfigError naming every reason the model cannot be split `size` ways."""
    problems = sequence_parallel_problems(size, **model_facts(model.config)) if hasattr(model, "config") else []
    modules = _attention_modules(model)
    if not modules:
        problems.append(f"actor.sequence_parallel_size={size}: {type(model).__name__} has no attention modules with "
                        "q_proj/k_proj/v_proj to split. Fix: set actor.sequence_parallel_size=1")
    if problems:
        raise ConfigError("sequence parallelism cannot run on this model:\n" + "\n".join(f"  - {p}" for p in problems))
    route_attention(modules, ATTENTION_NAME, ulysses_attention, _MARKER)
    return len(modules)


__all__ = ["ATTENTION_NAME", "KWARG", "SUPPORTED_MODEL_TYPES", "SequenceParallel", "SplitCall",
           "describe_sequence_parallel", "enable_sequence_parallel",
           "gather_sequence", "heads_to_seq", "kv_heads_sent", "model_facts", "seq_to_heads",
           "sequence_parallel_layout", "sequence_parallel_problems", "ulysses_attention"]
