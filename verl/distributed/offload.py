"""Activation offload: the tensors a forward saves for its backward wait in host memory instead of the GPU.

`torch.autograd.graph.save_on_cpu` copies every tensor autograd saves to (pinned) CPU memory as the forward
makes it and back as the backward needs it, so a long sequence's activations cost host memory, not device
memory, for the price of the copies; the arithmetic is the same, so the gradients are too. Under per-layer
activation checkpointing only the layer inputs are saved outside the checkpointed regions, so those are what
moves. On a CPU device every tensor already lives in host memory: there it is off (a copy would only double
them).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def offloads_activations(enabled: bool, device: torch.device) -> bool:
    """Whether `*.activation_offload` moves anything on `device` (a GPU; host memory is where it would go)."""
    return enabled and device.type != "cpu"


def activations_offloaded(enabled: bool, device: torch.device) -> Any:
    """A context for a forward whose saved tensors go to host memory where `offloads_activations`, else
    nothing. Only the forward needs to run inside it: the backward brings the tensors back by itself."""
    if not offloads_activations(enabled, device):
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


__all__ = ["activations_offloaded", "offloads_activations"]
