"""Model forward passes the trainers share: response log-probs (+ entropy) and critic values.

Only the response positions are turned into log-probs, and in float32, so a long prompt costs no
vocabulary-sized memory.
"""

from __future__ import annotations

import functools
import inspect

import torch

from verl.algorithms import entropy_from_logits, token_logprobs


@functools.cache
def _accepts(model_type: type, name: str) -> bool:
    """Whether the model class's forward takes `name` (asked once per class: this is the RL hot path)."""
    try:
        return name in inspect.signature(model_type.forward).parameters
    except (TypeError, ValueError):
        return False


def sequence_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    keep_last: int,
) -> torch.Tensor:
    """Logits predicting the last `keep_last` tokens: [B, keep_last, V] (float32, or float64 for a float64 model)."""
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
              "use_cache": False}
    if _accepts(type(model), "logits_to_keep"):
        kwargs["logits_to_keep"] = keep_last + 1
    logits = model(**kwargs).logits[:, -keep_last - 1 : -1, :]
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
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    labels = input_ids[:, -response_len:]
    logprobs = token_logprobs(logits, labels)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return logprobs, entropy


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
