"""Model forward passes the trainers share: response log-probs (+ entropy) and critic values.

Only the response positions are turned into log-probs, and in float32, so a long prompt costs no
vocabulary-sized memory.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.distributed.fsdp import FSDPModule

from verl.algorithms import entropy_from_logits, token_logprobs
from verl.models.lora import base_of
from verl.utils.positions import position_ids_from_mask


@functools.cache
def _accepts(model_type: type, name: str) -> bool:
    """Whether the model class's forward takes `name` (asked once per class: this is the RL hot path).
    Pass the type of `base_of(model)`: a peft wrapper's forward takes **kwargs and hands them to that model."""
    try:
        return name in inspect.signature(model_type.forward).parameters
    except (TypeError, ValueError):
        return False


@functools.cache
def _keeps_positions(model_type: type) -> bool:
    """Whether the forward's `logits_to_keep` also takes a tensor of positions (transformers' `int | Tensor`),
    not only a count of last positions: then the head runs on exactly the positions whose logits are used."""
    try:
        param = inspect.signature(model_type.forward).parameters.get("logits_to_keep")
    except (TypeError, ValueError):
        return False
    return param is not None and "Tensor" in str(param.annotation)


def _head_positions(model_type: type, total: int, start: int, stop: int,
                    device: torch.device) -> tuple[dict[str, object], slice]:
    """Forward kwargs and a slice of its logits that give the logits of positions [start, stop) of a
    `total`-position input. The head (and its backward) runs on those positions only where the model takes
    positions; else on the last `total - start` (or all) positions, cut down afterwards."""
    if 0 <= start < stop and _keeps_positions(model_type):
        return {"logits_to_keep": torch.arange(start, stop, device=device)}, slice(None)
    if _accepts(model_type, "logits_to_keep"):
        return {"logits_to_keep": total - start}, slice(0, stop - start)
    return {}, slice(start, stop)


def sequence_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    keep_last: int,
) -> torch.Tensor:
    """Logits predicting the last `keep_last` tokens: [B, keep_last, V] (float32, or float64 for a float64 model)."""
    total = input_ids.shape[1]
    head, cut = _head_positions(type(base_of(model)), total, max(total - keep_last - 1, 0), total - 1,
                                input_ids.device)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                   **head).logits[:, cut, :]
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_len: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each response token under `model` (logits / temperature, as sampled), optional entropy.

    `entropy_grad=False` computes the entropy for logging only, without adding it to the autograd graph.
    """
    logits = sequence_logits(model, input_ids, attention_mask, position_ids, response_len)
    return _logprobs(logits, input_ids[:, -response_len:], temperature, with_entropy, entropy_grad)


def _logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool,
              entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logprobs = token_logprobs(logits, labels)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return logprobs, entropy


def can_share_prompt(model: torch.nn.Module) -> bool:
    """Whether `shared_prompt_logits` applies to `model`: a causal LM that takes a KV cache, without
    gradient or activation checkpointing (which turn the cache off, or recompute into it, in training)."""
    inner = getattr(model, "module", model)
    checkpointing = getattr(inner, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(inner, "is_gradient_checkpointing", False)
    # fsdp.activation_checkpointing patches each decoder layer's forward (verl.distributed.fsdp): its
    # recomputation in backward would append the prompt's keys/values to the shared cache a second time
    checkpointing = checkpointing or any(getattr(m, "_verl_checkpointed", False) for m in inner.modules())
    return (_cache_argument(type(model)) is not None and _accepts(type(model), "use_cache")
            and not checkpointing)


def _cache_argument(model_type: type) -> str | None:
    """The forward's KV-cache argument: `cache` (transformers >= 5.2x) or `past_key_values` (before)."""
    for name in ("cache", "past_key_values"):
        if _accepts(model_type, name):
            return name
    return None


def shared_prompt_logits(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_attention: torch.Tensor,
) -> torch.Tensor:
    """The logits `sequence_logits` gives for the responses ([B, R, V]), running each distinct prompt once.

    Rows with identical (left-padded) prompts, such as the n samples of a GRPO group, share one prompt
    forward; its keys/values (with their autograd graph) are indexed out to every row, and the responses
    run on them. The first response token is predicted by the prompt's last position, the others by the
    response positions before them. Positions and the attention mask are those of the whole sequence, so
    the result equals the unshared forward up to float rounding (and so does every gradient).
    """
    mask = torch.cat([prompt_mask, response_attention.to(prompt_mask.dtype)], dim=1)
    positions = position_ids_from_mask(mask)
    _, inverse = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), len(inverse), dtype=torch.long, device=inverse.device)
    first = first.scatter_reduce(0, inverse, torch.arange(len(inverse), device=inverse.device), "amin")
    name = _cache_argument(type(model))
    keep = (lambda k: {"logits_to_keep": k}) if _accepts(type(model), "logits_to_keep") else (lambda k: {})
    # The prompt's last token goes with the responses, so that every logit used comes out of one
    # projection of whole rows. (A projection of a [G, 1, H] slice takes a different matmul kernel depending
    # on whether the weights require grad, so a frozen reference would differ from an identical policy by
    # float rounding.) Always two forwards: a data-independent count keeps FSDP's all-gathers in step.
    cut = max(prompt_ids.shape[1] - 1, 1)
    out = model(input_ids=prompt_ids[first, :cut], attention_mask=prompt_mask[first, :cut],
                position_ids=positions[first, :cut], use_cache=True, **keep(1))
    cache = getattr(out, "cache", None)
    cache = out.past_key_values if cache is None else cache
    cache.batch_select_indices(inverse)
    tail = torch.cat([prompt_ids[:, cut:], response_ids], dim=1)
    # the tail's last position predicts past the response: no logit of it is used
    head, used = _head_positions(type(model), tail.shape[1], 0, tail.shape[1] - 1, tail.device)
    logits = model(input_ids=tail, attention_mask=mask, position_ids=positions[:, cut:], use_cache=True,
                   **{name: cache}, **head).logits[:, used, :]
    if prompt_ids.shape[1] == 1:  # one-token prompts: their logit came out of the prompt forward
        logits = torch.cat([out.logits[:, -1:, :][inverse], logits], dim=1)
    elif torch.is_grad_enabled() and isinstance(base_of(model), FSDPModule):
        # The gradient reaches the prompt forward through the cached keys/values only, which bypasses the
        # per-layer outputs that FSDP2 hooks to gather each layer's weights for backward; a zero-weighted
        # term on its logits puts those outputs on the backward path (the values do not change). Unsharded,
        # nothing needs it, and it costs a pass over the [B, T, V] logits forward and backward.
        logits = logits + 0.0 * out.logits.sum()
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def shared_prompt_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_attention: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` with each distinct prompt run once (see `shared_prompt_logits`)."""
    logits = shared_prompt_logits(model, prompt_ids, prompt_mask, response_ids, response_attention)
    return _logprobs(logits, response_ids, temperature, with_entropy, entropy_grad)


def response_values(
    critic: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_len: int,
) -> torch.Tensor:
    """V(s_t) for each response token t: the value at the position that predicts it."""
    values = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return values[:, -response_len - 1 : -1].float()
