"""`RLTrainer.from_pretrained(...)`'s arguments, as TRL users write them, turned into one config.

The Python API builds the same typed `RunConfig` as YAML and the CLI (one schema, one source of defaults);
what cannot be config (a model object, Python reward functions, in-memory rows) is handed to the trainer
as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from verl.config.loader import build_config, set_dotted
from verl.config.schema import RunConfig
from verl.data.hf import is_hf
from verl.errors import ConfigError

RewardArg = str | Callable[..., Any] | Mapping[str, Any] | Sequence[Any] | None


@dataclass
class PythonRun:
    config: RunConfig
    model: torch.nn.Module | None  # a model object passed in (else config.model.path is loaded)
    rows: Any  # prompt rows passed in: a list of dicts, or a datasets.Dataset / DatasetDict (duck-typed)
    reward_functions: list[Any] | None  # Python callables (with any specs beside them)


def lora_section(peft_config: Any) -> dict[str, Any]:
    """A peft `LoraConfig` (TRL's `peft_config=`) as our `model.lora` section."""
    if isinstance(peft_config, Mapping):
        return dict(peft_config)
    rank = getattr(peft_config, "r", None)
    if not isinstance(rank, int):
        raise ConfigError(f"peft_config={type(peft_config).__name__}: expected a peft LoraConfig (with r, "
                          "lora_alpha, lora_dropout, target_modules) or a dict of model.lora keys, e.g. "
                          "{'rank': 16, 'alpha': 32}")
    targets = getattr(peft_config, "target_modules", None)
    section = {"rank": rank, "alpha": getattr(peft_config, "lora_alpha", None),
               "dropout": getattr(peft_config, "lora_dropout", 0.0) or 0.0,
               "modules_to_save": getattr(peft_config, "modules_to_save", None)}
    if targets is not None:
        section["target_modules"] = targets if isinstance(targets, str) else sorted(targets)
    return {k: v for k, v in section.items() if v is not None}


def _reward_specs(reward_fn: RewardArg) -> tuple[list[Any] | None, list[Any] | None]:
    """(specs for reward.functions, Python reward functions): a name or `path.py:fn` is a spec, a callable is
    passed as it is; a list with any callable goes to the trainer whole (specs and callables mix there)."""
    if reward_fn is None:
        return None, None
    if not (isinstance(reward_fn, (str, Mapping, Sequence)) or callable(reward_fn)):
        raise ConfigError(f"reward_fn={reward_fn!r} ({type(reward_fn).__name__}): pass a reward name "
                          "('numeric_match', 'rewards.py:fn'), a function fn(prompt, response, ground_truth, "
                          "**meta), or a list of them")
    items = [reward_fn] if isinstance(reward_fn, (str, Mapping)) or callable(reward_fn) else list(reward_fn)
    specs = [{"name": item} if isinstance(item, str) else item for item in items]
    return (None, specs) if any(callable(item) for item in specs) else (specs, None)


def python_run(model: str | torch.nn.Module | Mapping[str, Any], *, reward_fn: RewardArg, dataset: Any,
               peft_config: Any, overrides: Mapping[str, Any], teacher_model: Any = None) -> PythonRun:
    """See `RLTrainer.from_pretrained`."""
    tree: dict[str, Any] = {}
    for key, value in overrides.items():  # a section dict is its dotted keys: both forms merge
        for sub, item in (value.items() if isinstance(value, Mapping) else [(None, value)]):
            set_dotted(tree, f"{key}.{sub}" if sub is not None else key, item)
    if isinstance(model, Mapping):  # the model section itself: {"path": ..., "lora": {...}}
        for sub, item in model.items():
            set_dotted(tree, f"model.{sub}", item)
    elif isinstance(model, str):
        set_dotted(tree, "model.path", model)
    elif not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model={model!r} ({type(model).__name__}): pass a path or hub id, a loaded model (with "
                          "tokenizer=...), or the model section as a dict, e.g. {'path': 'tiny', 'lora': {'rank': 8}}")
    if peft_config is not None:
        for sub, item in lora_section(peft_config).items():
            set_dotted(tree, f"model.lora.{sub}", item)
    if teacher_model is not None:
        if not isinstance(teacher_model, str):
            raise ConfigError(f"teacher_model={type(teacher_model).__name__}: pass the teacher as a path or hub id "
                              "(it is loaded on the teacher's own ranks, devices.teacher), e.g. "
                              "teacher_model='Qwen/Qwen2.5-7B-Instruct'")
        set_dotted(tree, "algorithm.distill.teacher_path", teacher_model)
    rows = None
    if isinstance(dataset, str) or (isinstance(dataset, Sequence) and dataset and isinstance(dataset[0], str)):
        set_dotted(tree, "data.train_files", [dataset] if isinstance(dataset, str) else list(dataset))
    elif is_hf(dataset):
        rows = dataset  # a datasets.Dataset / DatasetDict: checked like a file, its rows read on demand
    elif dataset is not None:
        rows = list(dataset)
    specs, functions = _reward_specs(reward_fn)
    if specs is not None:
        set_dotted(tree, "reward.functions", specs)
    config = build_config(tree, source="RLTrainer.from_pretrained arguments")
    return PythonRun(config, model if isinstance(model, torch.nn.Module) else None, rows, functions)


__all__ = ["PythonRun", "lora_section", "python_run"]
