"""FSDPConfig -> FSDP2 `fully_shard`, activation checkpointing per decoder layer, full state dicts.

Each decoder layer becomes its own FSDP unit (so only one layer's full weights are gathered at a time),
then the root module takes the rest (embeddings, final norm, head). Parameter names are left untouched:
activation checkpointing wraps the layer's forward instead of the module, so checkpoints and HF exports
keep the original keys.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.utils.checkpoint import checkpoint

from verl.config.fsdp import FSDPConfig
from verl.errors import ConfigError, DistributedError


def find_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformer: HF's `_no_split_modules` classes, else the largest ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    if names:
        layers = [m for m in model.modules() if type(m).__name__ in names]
        if layers:
            return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    return list(max(lists, key=len))


def enable_activation_checkpointing(layers: list[nn.Module]) -> None:
    """Recompute each layer's activations in backward (non-reentrant checkpoint around its forward).

    Patching `forward` on the instance keeps module names (no `_checkpoint_wrapped_module.` prefix in
    state dict keys) and keeps FSDP's hooks outside the checkpointed region, as fully_shard expects.
    """
    for layer in layers:
        if getattr(layer, "_verl_checkpointed", False):
            continue
        inner = layer.forward

        @functools.wraps(inner)
        def forward(*args: Any, __inner=inner, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return __inner(*args, **kwargs)
            return checkpoint(__inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
        layer._verl_checkpointed = True


def _no_layers(model: nn.Module) -> ConfigError:
    return ConfigError(
        f"fsdp.activation_checkpointing=true but {type(model).__name__} has no decoder layers to checkpoint "
        f"(no _no_split_modules and no nn.ModuleList). Fix: pass layers=[...] or turn it off."
    )


def checkpoint_decoder_layers(model: nn.Module) -> None:
    """`fsdp.activation_checkpointing` on a model FSDP2 does not wrap (one process): the same per-layer
    recomputation apply_fsdp sets up."""
    layers = find_decoder_layers(model)
    if not layers:
        raise _no_layers(model)
    enable_activation_checkpointing(layers)


def _mesh_from(mesh: Any, group: Any, cfg: FSDPConfig, device_type: str) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    needs_2d = cfg.sharding_strategy in ("HYBRID_SHARD", "NO_SHARD")
    if mesh is not None:
        if needs_2d and mesh.ndim != 2:
            raise ConfigError(
                f"fsdp.sharding_strategy={cfg.sharding_strategy} needs a 2-D (replicate, shard) mesh, got a "
                f"{mesh.ndim}-D mesh. Fix: pass RoleGroups.mesh(role), which builds it from groups created up front."
            )
        if not needs_2d and mesh.ndim != 1:
            raise ConfigError(
                f"fsdp.sharding_strategy={cfg.sharding_strategy} shards over a 1-D mesh, got a {mesh.ndim}-D mesh. "
                f"Fix: use HYBRID_SHARD for 2-D meshes, or pass RoleGroups.mesh(role)."
            )
        return mesh
    if needs_2d:
        raise ConfigError(
            f"fsdp.sharding_strategy={cfg.sharding_strategy} needs a 2-D mesh whose groups exist on every rank. "
            f"Fix: create RoleGroups with fsdp=<this config> and pass mesh=role_groups.mesh(role)."
        )
    if not dist.is_initialized():
        raise DistributedError(
            "apply_fsdp needs an initialised process group. Fix: call verl.distributed.init_distributed() first "
            "(or skip FSDP when running a single process)."
        )
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    return DeviceMesh.from_group(group, device_type, mesh=torch.tensor(ranks, dtype=torch.int))


def apply_fsdp(
    model: nn.Module,
    cfg: FSDPConfig,
    *,
    mesh: Any | None = None,
    group: Any | None = None,
    layers: list[nn.Module] | None = None,
    device_type: str | None = None,
) -> nn.Module:
    """Shard `model` in place with FSDP2 as `cfg` says and return it (now an FSDPModule).

    Pass `mesh` (from RoleGroups.mesh(role)) or a 1-D `group`; neither means the whole world, FULL_SHARD /
    SHARD_GRAD_OP only. Call `cfg.check(...)` at start-up first: it validates combinations and returns the
    notes to print. The optimizer must be built after this call (parameters become DTensors).
    """
    dev = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    blocks = find_decoder_layers(model) if layers is None else layers
    if cfg.activation_checkpointing and not blocks:
        raise _no_layers(model)
    mesh = _mesh_from(mesh, group, cfg, dev)
    dtypes = cfg.mixed_precision_dtypes(dev)
    mp = (
        MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1])
        if dtypes is not None
        else MixedPrecisionPolicy()
    )
    # On a CPU device the policy moves nothing (the shards already live in host memory) but takes the same
    # path as on a GPU: the optimizer steps on CPU DTensors (what tests over gloo check).
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cfg.cpu_offload else OffloadPolicy()
    )
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(blocks)
    kwargs = dict(
        mesh=mesh, reshard_after_forward=cfg.reshard_after_forward, mp_policy=mp, offload_policy=offload
    )
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)  # the rest: embeddings, final norm, head (resharded after forward like the layers)
    return model


def full_state_dict(model: nn.Module, *, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """Unsharded weights under their original names (for HF export / comparisons).

    Collective: every rank of the model's mesh must call it. With cpu_offload=True (default) only rank 0
    receives the tensors (on CPU) and the other ranks get an empty dict, which bounds host memory.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    )


def load_full_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor], *, from_rank0: bool = True
) -> None:
    """Load unsharded weights into a sharded model; with from_rank0 only rank 0 needs `state_dict`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(
        model,
        state_dict,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0),
    )


@contextlib.contextmanager
def gathered(module: nn.Module, reshard_after_forward: bool | int = True) -> Iterator[None]:
    """Keep a sharded model's weights gathered for a while (generation): no collective per forward, so
    ranks whose responses finish at different steps cannot deadlock each other. A no-op unsharded."""
    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in sharded:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in sharded:
            m.reshard()
            m.set_reshard_after_forward(reshard_after_forward, recurse=False)


__all__ = [
    "apply_fsdp",
    "checkpoint_decoder_layers",
    "find_decoder_layers",
    "enable_activation_checkpointing",
    "full_state_dict",
    "gathered",
    "load_full_state_dict",
]
