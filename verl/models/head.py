"""A causal LM's output head, seen from outside: can log-probs be computed from the head's input (the final
hidden states) and its weight, and what were they in a given forward?

`HeadCapture` lets the model run its own forward (FSDP2's hooks, a peft wrapper, the KV cache all work as
usual) and takes the head over: a pre-hook records the hidden states the head receives and hands the head
only their last position, so the model makes one position's logits instead of [B, T, V]. The weight is
read from the projection that actually runs (a peft `modules_to_save` copy of the head, or the original
under `disable_adapter()`), at the moment it runs, which under FSDP2 is the gathered, unsharded parameter.
FSDP2 would free that parameter after the forward and gather it again only when a gradient reaches the
model's outputs, which the chunked loss bypasses; so while a capture is open the FSDP unit holding the head
stays gathered after its forward, and keeps so until its backward ends (FSDP2's end-of-backward callback
reduce-scatters the head's gradient and reshards it; without gradients the capture reshards it on exit). That
one position's logits also check, on every forward, that the model adds nothing after the projection
(softcapping, a logit scale).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from verl.errors import ModelError
from verl.models.lora import base_of
from verl.utils.cpu_matmul import OneDNNLinear

# A projection's classes: `trainer.cpu_matmul=onednn` swaps nn.Linear's class, not what the layer computes.
_LINEAR = (nn.Linear, OneDNNLinear)

# Config keys of architectures that transform the head's output (Gemma 2/3 softcapping, Cohere's and
# Granite's scales): the log-probs are then not those of the projection.
_POST_HEAD = {"final_logit_softcapping": None, "logit_scale": None, "logits_scaling": 1.0}


@dataclass(frozen=True)
class HeadOutput:
    """One forward's head input [..., H] and the projection it went through."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None


def output_head(model: nn.Module) -> nn.Module | None:
    """The module that turns hidden states into logits (under a peft wrapper or `AdapterOff` too)."""
    get = getattr(base_of(model), "get_output_embeddings", None)
    return get() if callable(get) else None


def _projections(head: nn.Module) -> list[nn.Linear]:
    return [m for m in head.modules() if type(m) in _LINEAR]


def head_unsupported(model: nn.Module) -> str | None:
    """None when the log-probs can be computed from the head's input and weight; else why not."""
    head = output_head(model)
    name = type(base_of(model)).__name__
    if head is None:
        return f"{name} has no output head (get_output_embeddings() gives None)"
    if type(head) not in _LINEAR:
        inner = [type(m).__name__ for m in head.children()]
        if type(head).__name__ != "ModulesToSaveWrapper" or not _projections(head):
            return (f"{name}'s output head is a {type(head).__name__} (LoRA on the head, or a custom head), not one "
                    "linear projection")
        if any(n not in ("Linear", "OneDNNLinear", "ModuleDict") for n in inner):
            return f"{name}'s output head wraps {', '.join(inner)}, not linear projections"
    cfg = getattr(base_of(model), "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    for key, neutral in _POST_HEAD.items():
        value = getattr(cfg, key, neutral)
        if value is not None and value != neutral:
            return f"{name} transforms the head's logits ({key}={value})"
    return None


class HeadCapture:
    """`with HeadCapture(model) as capture: out = model(...); h = capture.take(out)` gives the head's input and
    projection of that forward; the model's own logits cover only the last position."""

    def __init__(self, model: nn.Module) -> None:
        why = head_unsupported(model)
        if why is not None:
            raise ModelError(f"chunked log-probs need a plain linear output head: {why}. "
                             "Fix: set actor.chunked_logprobs=false (or auto, which falls back by itself)")
        self.head = output_head(model)
        self._unit = _fsdp_unit_of(base_of(model), self.head)
        self._hooks: list[Any] = []
        self._hidden: list[torch.Tensor] = []
        self._used: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def __enter__(self) -> HeadCapture:
        self._hooks.append(self.head.register_forward_pre_hook(self._take_input))
        self._hooks += [m.register_forward_pre_hook(self._record_projection) for m in _projections(self.head)]
        if self._unit is not None:
            self._reshard = self._unit._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
            self._unit.set_reshard_after_forward(False, recurse=False)
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._unit is not None:
            self._unit.set_reshard_after_forward(self._reshard, recurse=False)
            if not torch.is_grad_enabled():  # no backward will reshard it
                self._unit.reshard()

    def _take_input(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        self._hidden.append(hidden)
        return (hidden[..., -1:, :], *args[1:])  # the model makes one position's logits (checked in take)

    def _record_projection(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._used.append((module.weight, module.bias))

    def take(self, output: Any) -> HeadOutput:
        """The head input of the forward that returned `output` (each forward's is taken once)."""
        if len(self._hidden) != 1 or len(self._used) != 1:
            raise ModelError(f"the output head ran {len(self._hidden)} time(s) through {len(self._used)} "
                             "projection(s) in one forward; chunked log-probs need exactly one linear projection. "
                             "Fix: set actor.chunked_logprobs=false")
        hidden, (weight, bias) = self._hidden.pop(), self._used.pop()
        logits = getattr(output, "logits", None)
        if logits is not None:
            with torch.no_grad():
                mine = nn.functional.linear(hidden[..., -1:, :].detach(), weight.detach(),
                                            None if bias is None else bias.detach())
                if mine.shape != logits.shape or not torch.allclose(mine.float(), logits.float(), rtol=1e-3, atol=1e-3):
                    raise ModelError(f"{type(self.head).__name__}'s logits are not its linear projection of the "
                                     "hidden states (the model transforms them after the head): chunked log-probs "
                                     "would differ. Fix: set actor.chunked_logprobs=false")
        return HeadOutput(hidden, weight, bias)


def _fsdp_unit_of(model: nn.Module, head: nn.Module) -> Any:
    """The innermost FSDP2 module whose subtree holds `head` (it gathers the head's weight), or None."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule) and any(x is head for x in m.modules())]
    return min(units, key=lambda m: sum(1 for _ in m.modules())) if units else None


__all__ = ["HeadCapture", "HeadOutput", "head_unsupported", "output_head"]
