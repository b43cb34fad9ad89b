"""Joining the process group torchrun describes: rank, world, backend and the device of this process."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl.errors import DeviceMappingError, DistributedError


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: global/local rank, world, backend and its device."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str | None
    device: torch.device

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def _env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as err:
        raise DistributedError(
            f"environment variable {name}={value!r} is not an integer. Fix: launch with torchrun, which sets it."
        ) from err


def backend_for(use_cuda: bool, cpu_collectives: bool) -> str:
    """NCCL for GPU tensors, gloo for CPU ones. With CPU offload some collectives get CPU tensors on a GPU
    run (FSDP2's gradient-norm reduction over offloaded gradients): NCCL refuses them, so such runs get
    a backend per device type, which routes each collective by its tensors' device."""
    if not use_cuda:
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"


def init_distributed(timeout_s: float = 600.0, *, use_gpu: bool | None = None,
                     cpu_collectives: bool = False) -> DistEnv:
    """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK, ...).

    Without torchrun variables it returns a single-process env and initialises nothing, so the same code
    path runs on a laptop. Picks NCCL when the run uses CUDA (`use_gpu`: None = when available; False for
    trainer.device=cpu, whose tensors NCCL would refuse), gloo otherwise, and both with
    `cpu_collectives` (CPU offload, see `backend_for`). Binds the process to cuda:LOCAL_RANK after checking
    the ordinal exists (the usual "invalid device ordinal" crash).
    """
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    use_cuda = torch.cuda.is_available() and use_gpu is not False
    if use_cuda:
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise DeviceMappingError(
                f"rank {rank} has LOCAL_RANK={local_rank} but this node sees only {count} CUDA device(s) "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Fix: torchrun "
                f"--nproc_per_node={count} or make more devices visible."
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = backend_for(use_cuda, cpu_collectives)
    if dist.is_initialized():
        return DistEnv(
            dist.get_rank(), dist.get_world_size(), local_rank, local_world_size, dist.get_backend(), device
        )
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        return DistEnv(0, 1, 0, 1, None, device)
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise DistributedError(
            f"WORLD_SIZE={world_size} is set but {', '.join(missing)} is not. Fix: launch with "
            f"`torchrun --nproc_per_node=N -m verl.cli.main train ...` (or `verl train --nproc N`), which sets "
            f"all rendezvous variables."
        )
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if use_cuda:
        kwargs["device_id"] = device
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
    return DistEnv(rank, world_size, local_rank, local_world_size, backend, device)



def init_single_process_group(device: torch.device, timeout_s: float = 600.0, *,
                              cpu_collectives: bool = False) -> DistEnv:
    """A 1-rank process group for a process started without torchrun, so FSDP2 (which needs a device mesh)
    can apply mixed precision and CPU offload there too. An in-memory store: no port, no rendezvous.
    `cpu_collectives` as for `init_distributed`."""
    backend = backend_for(device.type == "cuda", cpu_collectives)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return DistEnv(0, 1, 0, 1, dist.get_backend(), device)


def shutdown_distributed() -> None:
    """Leave the process group at the end of a run. Without it, gloo/NCCL threads still alive at
    interpreter exit can abort the process ("terminate called without an active exception"), and a run
    that finished reports a failure to torchrun."""
    from verl.distributed.heartbeat import stop_heartbeat

    stop_heartbeat()  # its last beat says this rank exited: the others do not take it for a silent one
    if dist.is_initialized():
        dist.destroy_process_group()
