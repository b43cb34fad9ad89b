"""LoRA through `peft`: adapters on a model, the policy with its adapters off, and the plain weights under them.

LoRA is a property of the model, not a trainer: the trainers load the policy as usual and
`apply_lora` wraps it in a `peft.PeftModel` whose base weights are frozen. Three consequences the rest
of verl relies on:

* the reference of RL and DPO is `AdapterOff(policy)`, the same module run inside
  `disable_adapter()`, so no second copy of the weights exists;
* checkpoints hold only what trains (`TRAINABLE_STATE_ONLY` marks such modules for `verl.checkpoint`):
  the adapters, any `modules_to_save`, a critic's value head, and their optimizer state;
* rollout runs the peft forward of the current adapters (`base_of(policy)` has the LoRA layers in it).

`peft` is imported only here and only when LoRA is on, so `import verl` never needs it.
"""

from __future__ import annotations

import copy
import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from verl.errors import ConfigError
from verl.utils.lora import ADAPTER_CONFIG, PEFT_HINT, TRAINABLE_STATE_ONLY, is_peft_model, require_peft


def base_of(model: nn.Module) -> nn.Module:
    """The Hugging Face model under a peft wrapper or an `AdapterOff` reference (with the LoRA layers in it),
    or `model` itself."""
    return model.get_base_model() if is_peft_model(model) or isinstance(model, AdapterOff) else model


def peft_config(cfg: Any, *, base_model_name_or_path: str | None, task_type: str | None = "CAUSAL_LM",
                vision: tuple[str, bool] | None = None) -> Any:
    """The `peft.LoraConfig` of a `model.lora` / `critic.lora` section. `vision`: a vision-language model's
    tower (its module name) and whether it trains: no adapter goes inside it; trained, it is a module saved
    in full with the adapters."""
    peft = require_peft()
    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    save = list(cfg.modules_to_save or [])
    exclude = None
    if vision is not None:
        tower, trains = vision
        exclude = rf"{re.escape(tower)}\..*"
        save += [tower.rsplit(".", 1)[-1]] if trains else []
    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.scale_alpha, lora_dropout=cfg.dropout, target_modules=targets,
                           modules_to_save=save or None, exclude_modules=exclude,
                           task_type=task_type, base_model_name_or_path=base_model_name_or_path)


def apply_lora(model: nn.Module, cfg: Any, *, base_model_name_or_path: str | None = None,
               where: str = "model.lora", task_type: str | None = "CAUSAL_LM",
               vision: tuple[str, bool] | None = None) -> nn.Module:
    """`model` wrapped with trainable LoRA adapters (new ones, or `cfg.path`'s), its base weights frozen;
    `vision` as `peft_config`."""
    peft = require_peft(where)
    name = base_model_name_or_path or getattr(model, "name_or_path", None)
    if cfg.path:
        wrapped = peft.PeftModel.from_pretrained(model, cfg.path, is_trainable=True)
    else:
        wrapped = peft.get_peft_model(model, peft_config(cfg, base_model_name_or_path=name, task_type=task_type,
                                                         vision=vision))
    if name:
        wrapped.peft_config["default"].base_model_name_or_path = name
    setattr(wrapped, TRAINABLE_STATE_ONLY, True)
    return wrapped


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters."""
    total = trainable = 0
    for p in model.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return trainable, total


class AdapterOff(nn.Module):
    """The reference as `policy` with its adapters switched off: the frozen base weights, no second copy.

    The policy is held outside the module tree (its parameters are the policy's, not the reference's),
    and it runs in eval mode here whatever mode the trainer left it in.
    """

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "policy", policy)
        self.eval()

    def get_base_model(self) -> nn.Module:  # for signature checks (`logits_to_keep`), like a peft model
        return base_of(self.policy)

    @property
    def config(self) -> Any:
        return self.policy.config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        was_training = self.policy.training
        self.policy.eval()
        try:
            with self.policy.disable_adapter():
                return self.policy(*args, **kwargs)
        finally:
            self.policy.train(was_training)


def plain_copy(model: nn.Module) -> nn.Module:
    """A deep copy of `model` as a plain Hugging Face model: adapters merged into the weights, if any."""
    if not is_peft_model(model):
        return copy.deepcopy(model)
    return copy.deepcopy(model).merge_and_unload()


@contextmanager
def adapters_disabled(model: nn.Module):
    """`model.disable_adapter()` for a peft model; nothing otherwise."""
    if is_peft_model(model):
        with model.disable_adapter():
            yield
    else:
        yield


def read_adapter_config(path: str | Path, *, where: str = "model.lora.path") -> dict[str, Any]:
    """`adapter_config.json` of an adapter folder (ConfigError if missing or unreadable)."""
    file = Path(path) / ADAPTER_CONFIG
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}={path}: cannot read {file} ({type(exc).__name__}: {exc}). Fix: point it at a "
                          "folder written by PeftModel.save_pretrained or `verl ckpt export STEP --adapter`") from None


__all__ = ["ADAPTER_CONFIG", "AdapterOff", "PEFT_HINT", "TRAINABLE_STATE_ONLY", "adapters_disabled", "apply_lora",
           "base_of", "count_parameters", "is_peft_model", "peft_config", "plain_copy", "read_adapter_config",
           "require_peft"]
