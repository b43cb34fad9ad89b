"""Turning ``app_state`` into a DCP state dict and back, and reading DCP metadata without trusting it.

DCP (``torch.distributed.checkpoint``) stores tensors by fully-qualified name, so a checkpoint written by
4 ranks loads on 1 rank or 8: that is why model and optimizer state go through it rather than through one
``torch.save`` per rank. An ``nn.Module`` under key ``K`` is paired with the optimizer under ``K_optimizer``
(or ``optimizer`` for ``model``) and both go through ``get_state_dict``/``set_state_dict``, which key the
optimizer state by parameter name instead of by position and so survive FSDP resharding.

DCP's own reader unpickles ``.metadata`` with plain ``pickle``; a checkpoint downloaded from somewhere
could run code that way. :class:`SafeFileSystemReader` unpickles it with an allow-list of the few DCP,
torch and pathlib types that metadata legitimately contains.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from verl.errors import CheckpointError
from verl.utils.lora import TRAINABLE_STATE_ONLY  # set by verl.models.lora on adapter models

_ALLOWED_MODULE_PREFIX = "torch.distributed.checkpoint."
_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib", "Path"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith(_ALLOWED_MODULE_PREFIX) and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # classes only: DCP dataclasses and enums, never functions
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not a type DCP metadata may contain")


def read_metadata_safely(path: Path) -> Metadata:
    """Unpickle a DCP ``.metadata`` file with an allow-list; raises CheckpointError naming the file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read DCP metadata ({exc}).") from exc
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # UnpicklingError, EOFError, ... all mean the same thing to the user
        raise CheckpointError(
            f"{path}: DCP metadata is unreadable or references a forbidden type ({exc}); the checkpoint "
            "is corrupt or was not written by torch.distributed.checkpoint. Use an earlier checkpoint."
        ) from exc
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path}: DCP metadata holds {type(md).__name__}, not Metadata.")
    return md


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is read with :func:`read_metadata_safely`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        md = read_metadata_safely(Path(self._get_metadata_path(rank)))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md




# How this process runs the optimizer step, not training state: a checkpoint saved where the fused kernel applied
# (plain tensors) must not turn it on for parameters that are DTensors here (a resume at another tensor-parallel
# size), nor off where it applies.
_KERNEL_FLAGS = ("fused", "foreach")


def _options(module: object, *, load: bool) -> StateDictOptions | None:
    """A module marked trainable-state-only (LoRA: frozen base weights, trainable adapters) saves and loads
    only its trainable parameters; the frozen ones come from the base model, never from the checkpoint."""
    if not getattr(module, TRAINABLE_STATE_ONLY, False):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=not load)


def _trainable_entries(module: object, msd: dict[str, Any]) -> dict[str, Any]:
    """Only the trainable parameters of a trainable-state-only module's state dict. (`ignore_frozen_params`
    alone keeps the second name of a tied frozen weight, e.g. a tied `lm_head.weight`: the whole vocabulary.)"""
    if not getattr(module, TRAINABLE_STATE_ONLY, False):
        return msd
    keep = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}  # type: ignore[attr-defined]
    return {k: v for k, v in msd.items() if k in keep}


def _optimizer_key(module_key: str) -> str:
    return "optimizer" if module_key == "model" else f"{module_key}_optimizer"


def _plan(app_state: dict[str, object]) -> list[tuple[str, str | None]]:
    """Pair modules with optimizers; reject what DCP cannot hold, naming the key."""
    pairs: list[tuple[str, str | None]] = []
    claimed: set[str] = set()
    for key, obj in app_state.items():
        if isinstance(obj, torch.nn.Module):
            okey = _optimizer_key(key)
            opt = app_state.get(okey)
            if opt is not None and isinstance(opt, torch.optim.Optimizer):
                pairs.append((key, okey))
                claimed.add(okey)
            else:
                pairs.append((key, None))
    for key, obj in app_state.items():
        if isinstance(obj, torch.nn.Module) or key in claimed:
            continue
        if isinstance(obj, torch.optim.Optimizer):
            raise CheckpointError(
                f"app_state['{key}'] is an optimizer with no module paired to it; put its model under "
                f"'{key.removesuffix('_optimizer') or 'model'}' (optimizer 'optimizer' pairs with 'model', "
                "'<name>_optimizer' with '<name>') so its state is keyed by parameter name."
            )
        if isinstance(obj, dict) or hasattr(obj, "state_dict"):
            pairs.append((key, None))
            continue
        raise CheckpointError(
            f"app_state['{key}'] is a {type(obj).__name__}, which has no state_dict(); pass an object with "
            "state_dict()/load_state_dict(), a dict of tensors, or put small JSON-able state in `extra`."
        )
    return pairs


def to_state_dict(app_state: dict[str, object]) -> dict[str, Any]:
    """The DCP state dict for ``app_state``; for loading it doubles as the template DCP fills in place."""
    sd: dict[str, Any] = {}
    for key, okey in _plan(app_state):
        obj = app_state[key]
        if okey is not None:
            msd, osd = get_state_dict(obj, app_state[okey], options=_options(obj, load=False))  # type: ignore[arg-type]
            sd[key], sd[okey] = _trainable_entries(obj, msd), osd
        elif isinstance(obj, torch.nn.Module):
            sd[key] = _trainable_entries(obj, get_model_state_dict(obj, options=_options(obj, load=False)))
        elif isinstance(obj, dict):
            sd[key] = obj
        else:
            sd[key] = obj.state_dict()  # type: ignore[union-attr]
    return sd


def apply_state_dict(app_state: dict[str, object], sd: dict[str, Any]) -> None:
    """Push a loaded DCP state dict back into the live objects of ``app_state``."""
    for key, okey in _plan(app_state):
        obj = app_state[key]
        if okey is not None:
            optimizer = app_state[okey]
            kernels = [{k: g[k] for k in _KERNEL_FLAGS if k in g} for g in optimizer.param_groups]  # type: ignore[union-attr]
            set_state_dict(obj, optimizer, model_state_dict=sd[key], optim_state_dict=sd[okey],  # type: ignore[arg-type]
                           options=_options(obj, load=True))
            for group, flags in zip(optimizer.param_groups, kernels, strict=True):  # type: ignore[union-attr]
                group.update(flags)
        elif isinstance(obj, torch.nn.Module):
            set_model_state_dict(obj, sd[key], options=_options(obj, load=True))
        elif isinstance(obj, dict):
            obj.update(sd[key])
        else:
            obj.load_state_dict(sd[key])  # type: ignore[union-attr]


def top_level_keys(md: Metadata) -> set[str]:
    """Top-level app_state keys present in a DCP checkpoint (``model``, ``optimizer``, ...)."""
    return {fqn.split(".", 1)[0] for fqn in md.state_dict_metadata}
