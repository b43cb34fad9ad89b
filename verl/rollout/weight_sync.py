"""Keep a rollout engine that holds its own copy of the weights (vLLM) sampling from the policy.

Our own sampler runs the policy module itself, so it is always in sync. vLLM loads a copy from the model's
files at start-up; after the first policy update it would sample from the initial weights for the rest of
the run (every step silently off-policy). :func:`synced` pushes the policy's current weights into such an
engine before it samples and puts it to sleep afterwards, so that, colocated with the trainer, its KV cache
does not occupy the memory the update needs. :func:`ready_to_sample` is what the trainer enters around a
rollout: our sampler gets the policy's weights gathered, an engine with its own weights gets them pushed
while the policy stays sharded.

:func:`policy_weights` is what is pushed: full (unsharded) tensors under the Hugging Face parameter names the
engine loaded from disk. An FSDP2-sharded policy is gathered tensor by tensor (one full tensor alive at a
time); a PEFT/LoRA policy is pushed merged (``W + B @ A * scale`` for the active adapters), since the engine
serves the base architecture.

Each shard is moved to the rank's device and cast to the dtype the engine holds (``engine.weight_dtype``: the
rollout's compute dtype, bfloat16 on a GPU by default) *before* it is gathered, so a push moves parameters x
2 bytes in bfloat16 over the GPU's collective backend. Gathering the float32 masters as they are held (what
``DTensor.full_tensor()`` does) moves twice the bytes, and, with ``actor.cpu_offload`` (the shards on the
CPU), all-gathers float32 CPU tensors over gloo before every rollout. A LoRA layer's update is added to its
base weight shard by shard in the weights' own (float32) dtype and the sum cast, so the engine receives
what it did when the full float32 tensors were merged and cast by its loader.

On an asynchronous rollout rank (``devices.rollout``) the weights arrive by broadcast instead
(:class:`DeliveryReceiver`): they go into the engine as they are received, and its rollouts push nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist

_LORA_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector",
               ".original_module.")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, whether it is a plain tensor or an FSDP2 DTensor shard."""
    with torch.no_grad():  # a gathered parameter needs no autograd history
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach()


def _mesh_device(mesh: Any) -> torch.device:
    """The device a DTensor's collectives run on: the current GPU of a CUDA mesh."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def gathered_for_push(tensor: torch.Tensor, *, device: torch.device | None = None,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor in `dtype` (floating point only; None = as held), gathered on `device`.

    A plain tensor is only cast. An FSDP2 DTensor's local shard is first moved to `device` (None: the device of
    its mesh, e.g. the rank's GPU when the shard was offloaded to the CPU) and cast, then gathered: one
    ``all_gather_into_tensor`` on the mesh's group for FSDP2's layout (dim-0 shards of a 1-D mesh, the last
    ones padded to equal size), ``DTensor.full_tensor`` of the moved shard for any other placement."""
    cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    with torch.no_grad():
        if not hasattr(tensor, "to_local"):
            return tensor.detach().to(dtype=cast)
        from torch.distributed.tensor import DTensor, Shard

        mesh, placements = tensor.device_mesh, tuple(tensor.placements)
        local = tensor.to_local().detach().to(device=device or _mesh_device(mesh), dtype=cast)
        if mesh.ndim != 1 or placements != (Shard(0),):
            return DTensor.from_local(local, mesh, placements, run_check=False, shape=tensor.shape,
                                      stride=tensor.stride()).full_tensor().detach()
        world, rows = mesh.size(), tensor.shape[0]
        chunk = -(-rows // world)  # torch.chunk's (and FSDP2's) rows per rank
        if local.shape[0] != chunk:  # a short (or empty) last shard: padded to the others' size
            padded = local.new_zeros((chunk, *tensor.shape[1:]))
            padded[: local.shape[0]] = local
            local = padded
        out = local.new_empty((world * chunk, *tensor.shape[1:]))
        dist.all_gather_into_tensor(out, local.contiguous(), group=mesh.get_group())
        return out[:rows] if world * chunk != rows else out


def _peft_base(model: torch.nn.Module) -> torch.nn.Module | None:
    """The wrapped transformers model of a PEFT model, else None."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else None


def _lora_delta(module: Any) -> torch.Tensor | None:
    """The weight update a LoRA layer adds on top of its base layer (None when merged or switched off)."""
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return None
    delta = None
    for name in getattr(module, "active_adapters", []):
        if name in getattr(module, "lora_A", {}) or name in getattr(module, "lora_embedding_A", {}):
            d = module.get_delta_weight(name)
            delta = d if delta is None else delta + d
    return delta


def policy_weights(model: torch.nn.Module, *, adapted_only: bool = False, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, full tensor) for every parameter and persistent buffer of the policy.

    Tied weights appear once (under the first name, as ``named_parameters`` gives them), as in the files.
    ``adapted_only`` (a PEFT policy): only what training can change, the merged weights of the LoRA layers and
    the ``modules_to_save`` copies; the frozen base weights the engine loaded from disk are left out.
    ``dtype``: floating-point tensors are cast to it before they are gathered (the dtype the engine holds;
    None = as held); ``device``: where a sharded tensor is gathered (None = its mesh's device; see
    :func:`gathered_for_push`).
    """
    def full(tensor: torch.Tensor) -> torch.Tensor:
        return gathered_for_push(tensor, device=device, dtype=dtype)

    base = _peft_base(model)
    if base is None:
        for name, param in model.named_parameters():
            yield name, full(param)
        persistent = {n for n, _ in model.state_dict().items()}
        for name, buf in model.named_buffers():
            if name in persistent:
                yield name, full(buf)
        return
    lora_modules = {name: mod for name, mod in base.named_modules()
                    if hasattr(mod, "base_layer") and (hasattr(mod, "lora_A") or hasattr(mod, "lora_embedding_A"))}
    for name, param in base.named_parameters():
        if any(part in name for part in _LORA_PARTS):
            continue
        owner, _, leaf = name.rpartition(".")
        adapted = ".modules_to_save." in name
        if adapted:  # a fully trained copy replaces the original module
            head, _, rest = name.partition(".modules_to_save.")
            name = f"{head}.{rest.split('.', 1)[1]}"
        elif owner.endswith(".base_layer"):
            layer = owner.removesuffix(".base_layer")
            name = f"{layer}.{leaf}"
            adapted = leaf == "weight"
            if adapted:
                with torch.no_grad():
                    delta = _lora_delta(lora_modules[layer])
                if delta is not None:
                    yield name, full(_merged(param, delta))
                    continue
        if adapted or not adapted_only:
            yield name, full(param)


def _merged(param: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``param + delta`` in the parameter's own dtype, shard by shard where both are sharded alike (an
    element-wise sum of the local shards is the sum's shard): nothing full-size is gathered for it."""
    with torch.no_grad():
        if hasattr(param, "to_local") and hasattr(delta, "to_local"):
            from torch.distributed.tensor import DTensor

            if tuple(delta.placements) != tuple(param.placements):
                delta = delta.redistribute(param.device_mesh, param.placements)
            local = param.to_local().detach()
            summed = local + delta.to_local().to(device=local.device, dtype=local.dtype)
            return DTensor.from_local(summed, param.device_mesh, param.placements, run_check=False,
                                      shape=param.shape, stride=param.stride())
        if hasattr(param, "to_local"):  # a sharded weight with an update held whole: merged whole, as before
            return _full(param) + _full(delta).to(device=param.device, dtype=param.dtype)
        return param.detach() + _full(delta).to(device=param.device, dtype=param.dtype)


@contextmanager
def synced(engine: Any, model: torch.nn.Module) -> Iterator[None]:
    """The engine awake and holding `model`'s current weights for the duration, asleep afterwards.

    A no-op for an engine that samples from the policy module itself (``holds_own_weights`` false).
    """
    if not getattr(engine, "holds_own_weights", False) or getattr(engine, "fed_by_deliveries", False):
        yield  # an asynchronous rollout rank's engine got the weights with the last delivery (DeliveryReceiver)
        return
    engine.load_policy_weights(policy_weights(model, dtype=getattr(engine, "weight_dtype", None)))
    try:
        yield
    finally:
        engine.sleep()


@contextmanager
def ready_to_sample(engine: Any, model: torch.nn.Module,
                    gathered: Callable[[torch.nn.Module], AbstractContextManager[None]]) -> Iterator[None]:
    """The engine ready to sample from `model`'s current weights for the duration.

    Our own sampler runs the policy module, so its weights stay gathered for the whole rollout (`gathered`,
    e.g. `distributed.fsdp.gathered`). An engine with its own weights (vLLM) gets them pushed one gathered
    tensor at a time, and the policy stays sharded while it samples: a gathered actor beside vLLM's own
    weights and KV cache would hold the full model twice on every GPU.
    """
    if getattr(engine, "holds_own_weights", False):
        with synced(engine, model):
            yield
    else:
        with gathered(model):
            yield


class DeliveryReceiver:
    """A rollout rank's end of an asynchronous weight delivery
    (`verl.rollout.async_rollout.AsyncRollout.deliver`): where the broadcast buckets of the trained
    parameters go.

    Our sampler runs the rollout rank's copy of the policy, so the buckets are unpacked into it. An engine with
    its own weights (vLLM) must end each delivery holding them: a full policy's buckets are loaded into it as
    they arrive, straight from the received (device) buffer under their Hugging Face names, and the copy is not
    updated (on a vLLM rollout rank it stays on the CPU as the delivery's layout only, see
    `verl.trainer.compose.components.setup_engine`); a LoRA policy's buckets are its adapters, which need the base
    weights to mean anything, so they are unpacked into the copy and, once all have arrived, the merged
    weights of the adapted layers are loaded (`policy_weights(adapted_only=True)`: the frozen base weights
    the engine loaded from disk never change)."""

    def __init__(self, engine: Any, model: torch.nn.Module) -> None:
        self.engine, self.model = engine, model
        self.pushes = bool(getattr(engine, "holds_own_weights", False))
        self.lora = _peft_base(model) is not None

    def bucket(self, params: list[tuple[str, torch.nn.Parameter]], flat: torch.Tensor) -> None:
        """One received bucket: `flat` holds `params`' new values, concatenated in order."""
        if self.pushes and not self.lora:
            self.engine.load_policy_weights(zip([name for name, _ in params], _views(flat, params), strict=True))
            return
        with torch.no_grad():
            for (_, p), value in zip(params, _views(flat, params), strict=True):
                p.copy_(value.to(p.device))

    def done(self) -> None:
        """Every bucket arrived: a LoRA policy's merged weights into the engine."""
        if self.pushes and self.lora:
            self.engine.load_policy_weights(policy_weights(self.model, adapted_only=True,
                                                           dtype=getattr(self.engine, "weight_dtype", None)))


def _views(flat: torch.Tensor, params: list[tuple[str, torch.nn.Parameter]]) -> Iterator[torch.Tensor]:
    offset = 0
    for _, p in params:
        yield flat[offset: offset + p.numel()].view(p.shape)
        offset += p.numel()


__all__ = ["DeliveryReceiver", "gathered_for_push", "policy_weights", "ready_to_sample", "synced"]
