"""Dropout off, for the passes PPO compares: the ratio new/old policy must start at exactly 1.

Hugging Face attention layers read a float attribute (`attention_dropout`) in `forward` rather than
an `nn.Dropout` module, so switching modules to eval() or zeroing `nn.Dropout.p` alone is not enough.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def disable_dropout(model: torch.nn.Module) -> int:
    """Zero every dropout probability in `model` (modules, float attributes and the config, so a copy made
    from the config has none either); returns how many were non-zero."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            changed += module.p > 0
            module.p = 0.0
        for owner in (module, getattr(module, "config", None)):
            for name, value in list(vars(owner).items()) if owner is not None else []:
                if "dropout" in name and isinstance(value, float) and not isinstance(value, bool):
                    changed += value > 0
                    setattr(owner, name, 0.0)
    return int(changed)


@contextmanager
def no_grad_eval(model: torch.nn.Module) -> Iterator[None]:
    """No gradient and eval mode (no dropout), restoring the module's previous mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


__all__ = ["disable_dropout", "no_grad_eval"]
