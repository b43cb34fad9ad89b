"""The settings every test run on the tiny model shares, and the tiny model itself loaded for a test module.

Importable from any test as `from tiny_support import ...`: tests/conftest.py puts this folder on sys.path
(pytest inserts a rootdir conftest's folder). The shared fixtures (`tiny_path`, `tiny`) are in that conftest.

A tiny run is `model.path=tiny` in float32 on the CPU, its metrics in `run_dir`/metrics.jsonl only; an RL one
also skips the validation before the first step and starts fresh (`trainer.resume=never`), so that a test's
first step is the first thing it runs. Two spellings of the same settings:

- `tiny_run_config(run_dir, "a.b=c", ...)`: `key=value` items, read by `load_config` as the command line;
- `tiny_config(run_dir, kind, {section: {key: value}}, ...)`: nested sections, validated by `build_config`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from verl.config import load_config
from verl.config.loader import build_config
from verl.config.schema import RunConfig

RunDir = Path | str


def tiny_overrides(run_dir: RunDir, kind: str = "rl") -> list[str]:
    """The tiny run's settings as `key=value` items (`trainer.kind` is written for the offline kinds only)."""
    items = ["model.path=tiny", "model.dtype=float32", "trainer.device=cpu", "logging.backends=[jsonl]",
             f"trainer.run_dir={run_dir}"]
    if kind == "rl":
        return [*items, "trainer.val_before_train=false", "trainer.resume=never"]
    return [*items, f"trainer.kind={kind}"]


def tiny_run_config(run_dir: RunDir, *overrides: str, kind: str = "rl") -> RunConfig:
    """`load_config` of the tiny run's items followed by `overrides` (later items win)."""
    return load_config(overrides=[*tiny_overrides(run_dir, kind), *overrides])


def tiny_tree(run_dir: RunDir | None = None, kind: str = "rl", *layers: Mapping[str, Mapping[str, Any]]) -> dict:
    """The tiny run's settings as nested sections, with each of `layers` merged on top in order: a layer's
    section updates the keys it names and keeps the others (`{"trainer": {"total_steps": 2}}` keeps the
    device). `run_dir=None` leaves the run folder unset."""
    trainer: dict[str, Any] = {"device": "cpu", "run_dir": str(run_dir) if run_dir is not None else None}
    if kind == "rl":
        trainer |= {"val_before_train": False, "resume": "never"}
    else:
        trainer["kind"] = kind
    tree: dict[str, Any] = {"model": {"path": "tiny", "dtype": "float32"}, "trainer": trainer,
                            "logging": {"backends": ["jsonl"]}}
    for layer in layers:
        for section, values in layer.items():
            tree.setdefault(section, {}).update(copy.deepcopy(values))
    return tree


def tiny_config(run_dir: RunDir | None = None, kind: str = "rl", *layers: Mapping[str, Mapping[str, Any]]) -> RunConfig:
    """`build_config` of `tiny_tree(run_dir, kind, *layers)`."""
    return build_config(tiny_tree(run_dir, kind, *layers))


def load_tiny(variant: str = "instruct", *, padding_side: str | None = None, chat_template: str | None = None,
              eval_mode: bool = False) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) of the tiny model (`variant`: instruct or base) in float32 on the CPU, as training
    loads it; `padding_side` / `chat_template` set on the tokenizer, `eval_mode` puts the model in eval mode."""
    from verl.models.hf_loader import load_hf_model
    from verl.models.tiny import build_tiny_model

    model, tok = load_hf_model(build_tiny_model(variant=variant), torch_dtype=torch.float32, device="cpu")
    if padding_side is not None:
        tok.padding_side = padding_side
    if chat_template is not None:
        tok.chat_template = chat_template
    return (model.eval() if eval_mode else model), tok
