"""The few LoRA names the checkpoint and model layers share (both sit above this one): the peft import with
its install hint, the trainable-state-only marker and the adapter config file name.

The adapters themselves (applying them, the adapter-off reference) live in `verl.models.lora`.
"""

from __future__ import annotations

from typing import Any

from verl.errors import ConfigError, install_hint

PEFT_HINT = install_hint("peft", "peft")
TRAINABLE_STATE_ONLY = "verl_trainable_state_only"
"""Attribute set on modules whose checkpoints hold only their trainable parameters (LoRA: the adapters)."""
ADAPTER_CONFIG = "adapter_config.json"
"""peft's adapter config; in a checkpoint's hf/ folder it marks a LoRA checkpoint and names the base model."""


def require_peft(where: str = "model.lora") -> Any:
    """The `peft` module, or a ConfigError saying how to install it."""
    try:
        import peft
    except ImportError:
        raise ConfigError(f"{where}: LoRA is on, but the `peft` package is not installed. Fix: {PEFT_HINT}, "
                          f"or set {where}.rank=0 to train every weight") from None
    return peft


def is_peft_model(model: Any) -> bool:
    """Whether `model` is a peft model (checked without importing peft)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


__all__ = ["ADAPTER_CONFIG", "PEFT_HINT", "TRAINABLE_STATE_ONLY", "is_peft_model", "require_peft"]
