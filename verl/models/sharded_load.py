"""Sharded start-up: a model built on the meta device, FSDP2-sharded, then each rank reads only its part.

The old start-up loaded every model whole on every rank before sharding it (at 7B, 28 GiB of float32 policy
plus its reference and critic copies per GPU). Here a role sharded over several ranks is built from its
config on the meta device (`defer_weights` records where each weight lies in the safetensors files), sharded
with `fully_shard`, and `materialise` then allocates this rank's shards and reads exactly their rows from the
files (`Shard(0)` chunks as DTensor lays them out; the last rank's chunk is the short one; with tensor
parallelism also the `Shard(1)` columns of row-wise weights, each rank reading the rows it holds a part of),
converting to each parameter's dtype as `from_pretrained` does. A copy of such a model (the reference as the policy's
initial weights, the critic's backbone) is a copy of the meta model, so it loads from the same files.

Tensors that are not on the meta device when the model is sharded (LoRA adapters, a critic's value head:
initialised on the CPU exactly as the unsharded path does, from the same seeded RNG) keep their values;
rotary-embedding buffers, which meta construction leaves empty, are recomputed as transformers does.
Anything else the files cannot supply makes `defer_weights` refuse, and the caller loads the old way.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verl.errors import ModelError

KEYS = "_verl_stored"  # on each module of a deferred model: {local tensor name: Stored}
ROPE = "_verl_recompute_rope"  # on a rotary-embedding module whose buffers are recomputed when materialised

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}

_lock = threading.Lock()
_bytes_read = 0


def bytes_read() -> int:
    """Bytes this process has read from safetensors files through `materialise` (tests and the benchmark
    check that each rank reads about 1/N of a sharded model)."""
    return _bytes_read


@dataclass(frozen=True)
class Stored:
    """Where one tensor lies in a safetensors file: its key, dtype, shape and absolute byte offset."""

    file: str
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    def read_rows(self, start: int, stop: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) along dim 0 (the whole tensor for a scalar), read from the file and nothing more;
        straight into `into` where it is a contiguous CPU tensor of the stored dtype and shape (no copy)."""
        global _bytes_read
        if not self.shape:
            start, stop, row_shape = 0, 1, ()
        else:
            row_shape = self.shape[1:]
        row_bytes = torch.Size(row_shape).numel() * torch.empty((), dtype=self.dtype).element_size()
        shape = ((stop - start), *row_shape) if self.shape else ()
        direct = (into is not None and into.device.type == "cpu" and into.dtype == self.dtype
                  and into.is_contiguous() and tuple(into.shape) == shape)
        out = into if direct else torch.empty(shape, dtype=self.dtype)
        if stop > start:
            view = memoryview(out.detach().reshape(-1).view(torch.uint8).numpy())
            with open(self.file, "rb") as f:
                f.seek(self.offset + start * row_bytes)
                got = f.readinto(view)
            if got != len(view):
                raise ModelError(f"{self.file}: tensor {self.key} is cut short ({got} of {len(view)} bytes read). "
                                 "Fix: the checkpoint is truncated; copy the file again.")
            with _lock:
                _bytes_read += got
        return out


def _header(file: Path) -> dict[str, Stored]:
    """The tensors of one safetensors file. A file that is not one (a header length past its end, a header
    that is not JSON) raises ValueError: the caller loads the old way, whose loader says what is wrong."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > file.stat().st_size - 8:
            raise ValueError(f"{file} is not a safetensors file (its header would be {length} bytes)")
        header = json.loads(f.read(length))
    base = 8 + length
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            return {}  # a dtype we do not read this way (fp8, ...): the caller loads the old way
        out[key] = Stored(str(file), key, dtype, tuple(info["shape"]), base + info["data_offsets"][0])
    return out


def safetensors_index(directory: str | os.PathLike) -> dict[str, Stored] | None:
    """Every tensor of the safetensors checkpoint in `directory` (one file or an index of shards), or None
    when there is none to read this way (.bin files, a hub id, an unknown dtype)."""
    path = Path(directory)
    index = path / "model.safetensors.index.json"
    try:
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (path / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            return None
        out: dict[str, Stored] = {}
        for name in files:
            stored = _header(path / name)
            if not stored:
                return None
            out.update(stored)
        return out
    except (OSError, ValueError, KeyError, struct.error):
        return None


def reads_shards(config: Any, *, world_size: int, split: bool, actor_ranks: int) -> bool:
    """The start-up rule: whether a run builds its models on the meta device and each rank reads only its
    shards of the weights after sharding, instead of loading each whole first. Every role on every rank (a
    colocated run) over more than one rank, so each model is sharded, and whatever a copy of the policy needs
    is in the files (no pretrained adapters to merge into the critic's or the reference's weights). The
    trainer (`verl.trainer.compose.components.sharded_start`) and the memory plan both ask it."""
    return (world_size > 1 and not split and actor_ranks > 1 and not config.model.lora.path
            and not config.critic.lora.path)


def _is_rotary(module: nn.Module) -> bool:
    return ("RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq")
            and hasattr(module, "rope_type") and hasattr(module, "config"))


def _rope_value(module: nn.Module) -> torch.Tensor:
    """The inverse frequencies transformers' `_init_weights` gives a rotary embedding built on meta."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    functions = {"axial": getattr(module, "compute_axial_rope_parameters", None),
                 "ntk_alpha": getattr(module, "compute_ntk_alpha_rope_parameters", None),
                 "default": getattr(module, "compute_default_rope_parameters", None), **ROPE_INIT_FUNCTIONS}
    value, _ = functions[module.rope_type](module.config)
    return value


def _candidates(name: str, prefix: str) -> list[str]:
    out = [name]
    if prefix:
        out.append(f"{prefix}.{name}")
        if name.startswith(prefix + "."):
            out.append(name[len(prefix) + 1:])
    return out


def defer_weights(model: nn.Module, directory: str | os.PathLike) -> bool:
    """Record on the meta-built `model` (a Hugging Face model) where each of its weights lies in
    `directory`'s safetensors files; False (nothing recorded) when some tensor cannot come from them that
    way: the caller then loads the model whole, as before."""
    index = safetensors_index(directory)
    if index is None or _has_weight_conversions(model):
        return False
    prefix = getattr(model, "base_model_prefix", "") or ""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    records: list[tuple[nn.Module, str, Stored]] = []
    rotary: list[nn.Module] = []
    for module_name, module in model.named_modules():
        dotted = f"{module_name}." if module_name else ""
        for local, p in module._parameters.items():
            if p is None:
                continue
            aliases = names[id(p)]
            stored = next((index[k] for a in aliases for k in _candidates(a, prefix) if k in index), None)
            if stored is None or stored.shape != tuple(p.shape) or not p.is_meta:
                return False
            records.append((module, local, stored))
        for local, b in module._buffers.items():
            if b is None or not b.is_meta:
                continue
            if local in module._non_persistent_buffers_set:
                if not (_is_rotary(module) and local in ("inv_freq", "original_inv_freq")):
                    return False
                rotary.append(module)
                continue
            stored = next((index[k] for k in _candidates(dotted + local, prefix) if k in index), None)
            if stored is None or stored.shape != tuple(b.shape):
                return False
            records.append((module, local, stored))
    for module, local, stored in records:
        module.__dict__.setdefault(KEYS, {})[local] = stored
    for module in rotary:
        setattr(module, ROPE, True)
    return True


def _has_weight_conversions(model: nn.Module) -> bool:
    """Whether transformers renames or reshapes this model type's checkpoint tensors as it loads them (fused
    experts, legacy names): read as stored, they would not be the model's."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return False
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return bool(model_type and get_checkpoint_conversion_mapping(model_type))


def is_deferred(model: nn.Module) -> bool:
    """Whether `model` (or a part of it) still waits for `materialise`."""
    return any(KEYS in m.__dict__ or getattr(m, ROPE, False) for m in model.modules()) and any(
        t.is_meta for t in _tensors(model))


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _region(t: torch.Tensor) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """This rank's part of `t` as global ([start, stop) of dim 0, [start, stop) of dim 1 or None for all of it):
    FSDP2's `Shard(0)` rows, a row-wise tensor-parallel weight's `Shard(1)` columns, or both on a 2-D mesh."""
    if not hasattr(t, "device_mesh"):
        return (0, t.shape[0] if t.dim() else 1), None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if any(offset[2:]) or tuple(shape[2:]) != tuple(t.shape[2:]):
        raise ModelError(f"a deferred weight of shape {tuple(t.shape)} is sharded on a dimension past 1 "
                         f"({t.placements}); the sharded loader reads rows and columns only. Fix: load the model "
                         "whole.")
    local = _local(t)
    if tuple(local.shape) != tuple(shape):
        raise ModelError(f"a deferred weight's local shard is {tuple(local.shape)} where its layout says "
                         f"{tuple(shape)}; this is a bug in verl.models.sharded_load, please report it.")
    if not t.dim():
        return (0, 1), None
    columns = None if t.dim() < 2 or tuple(shape[1:2]) == tuple(t.shape[1:2]) else (offset[1], offset[1] + shape[1])
    return (offset[0], offset[0] + shape[0]), columns


@torch.no_grad()
def materialise(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Give a deferred `model` (sharded with `fully_shard`, or not) real storage on `device` and fill this
    rank's part of every tensor: weights read from the files, values it already had (not on the meta device)
    kept, rotary buffers recomputed. Nothing outside this rank's shards is read."""
    kept = {}  # (module, name) -> the local values a tensor had before (LoRA adapters, a value head)
    for module in model.modules():
        for local, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None and not t.is_meta:
                kept[(id(module), local)] = _local(t).detach().clone()
    shared: dict[int, list[tuple[nn.Module, str]]] = {}  # tied weights (lm_head = embed_tokens): one tensor
    for module in model.modules():
        for local, p in module._parameters.items():
            if p is not None:
                shared.setdefault(id(p), []).append((module, local))
    model.to_empty(device=device)
    for places in shared.values():  # to_empty gives each module its own new tensor where the devices differ
        first = places[0][0]._parameters[places[0][1]]
        for module, local in places[1:]:
            if module._parameters[local] is not first:
                module._parameters[local] = first
    done: set[int] = set()
    for module in model.modules():
        stored = module.__dict__.get(KEYS, {})
        for local, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None or id(t) in done:
                continue
            done.add(id(t))
            target = _local(t)
            if (id(module), local) in kept:
                target.copy_(kept[(id(module), local)])
            elif local in stored:
                (start, stop), columns = _region(t)
                if columns is None:
                    rows = stored[local].read_rows(start, stop, into=target)
                    if rows is not target:
                        target.copy_(rows.reshape(target.shape))
                else:  # whole rows through host memory, then this rank's columns of them
                    target.copy_(stored[local].read_rows(start, stop)[:, columns[0]:columns[1]])
            elif getattr(module, ROPE, False) and local in ("inv_freq", "original_inv_freq"):
                target.copy_(_rope_value(module))
            else:
                raise ModelError(f"{type(module).__name__}.{local} has no source after sharded loading (not in the "
                                 "checkpoint, not initialised before sharding); this is a bug in "
                                 "verl.models.sharded_load, please report it.")
    for module in model.modules():
        module.__dict__.pop(KEYS, None)
        if getattr(module, ROPE, False):
            delattr(module, ROPE)
    return model


@contextlib.contextmanager
def adapters_off_meta() -> Iterator[None]:
    """peft moves new adapters to their base layer's device; on a meta-built model keep them on the CPU, where
    they are initialised exactly as on a loaded one (same layers, same draws from the seeded RNG), so
    `materialise` keeps their values instead of leaving them empty. (Only while adapters are added: a move of
    a module to the meta device keeps it where it is, converting its dtype as asked.)"""
    from peft.tuners.tuners_utils import BaseTunerLayer

    original_move = BaseTunerLayer._move_adapter_to_device_of_base_layer
    original_to = nn.Module.to

    def move(self: Any, adapter_name: str, device: torch.device | None = None) -> None:
        if device is None:
            base = self.get_base_layer()
            weight = getattr(getattr(base, "out_proj", base), "weight", None)
            if weight is not None and weight.is_meta:
                device = torch.device("cpu")
        original_move(self, adapter_name, device)

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type == "meta" and not all(t.is_meta for t in _tensors(self)):
            return original_to(self, dtype) if dtype is not None else self
        return original_to(self, *args, **kwargs)

    BaseTunerLayer._move_adapter_to_device_of_base_layer = move
    nn.Module.to = to
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = original_move
        nn.Module.to = original_to

__all__ = ["Stored", "adapters_off_meta", "bytes_read", "defer_weights", "is_deferred", "materialise",
           "reads_shards", "safetensors_index"]
