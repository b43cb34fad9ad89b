"""Process set-up for a trainer: which rank this is, its device and dtype, its roles, seeds and RNG streams.

Kept apart from the trainers so that `verl check` resolves devices and dtypes exactly as a run would,
and so a reader sees every piece of per-process state a trainer starts with in one dataclass.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from verl.config.schema import RunConfig
from verl.distributed import RoleGroups, init_distributed
from verl.distributed.heartbeat import start_heartbeat
from verl.distributed.mapping import DeviceMapping
from verl.distributed.process import init_single_process_group
from verl.errors import ConfigError
from verl.trainer.build.fsdp_launch import fsdp_launch
from verl.trainer.build.precision import resolve_precision
from verl.utils.dtype import resolve_dtype


@dataclass
class ProcessSetup:
    """Everything a trainer knows about its process before any model loads."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dtype: torch.dtype  # trained roles' master weights (`verl.trainer.build.precision`)
    roles: set[str]
    split: bool
    dp_rank: int
    dp_size: int
    generator: torch.Generator
    shuffle_generator: torch.Generator
    groups: Any = None
    frozen_dtype: torch.dtype | None = None  # the reference's weights; None = `dtype`


@dataclass(frozen=True)
class ProcessIdentity:
    """Rank numbers from the launcher (torchrun sets them; one process otherwise)."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls) -> ProcessIdentity:
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu "
                              "(or auto), or check CUDA_VISIBLE_DEVICES and the torch build (`verl doctor`)")
        return torch.device("cuda", local_rank)
    if name != "cpu":
        raise ConfigError(f"trainer.device={name!r}: use auto, cpu or cuda")
    return torch.device("cpu")


def run_dtype(name: str, device_type: str) -> torch.dtype:
    """`model.dtype` as a run holds a trained model's weights: 'auto' is float32 master weights everywhere
    (a GPU computes in bfloat16 through `fsdp.mixed_precision`; see `verl.trainer.build.precision`)."""
    if name == "auto":
        return torch.float32
    return resolve_dtype(name)


def frozen_dtype(config: RunConfig, device_type: str, name: str | None = None) -> torch.dtype:
    """A frozen model's dtype (reference; reward model: `name` = reward.model_dtype): the dtype the actor
    computes in (bfloat16 on a GPU by default), unless `name` sets one."""
    if name and name != "auto":
        return resolve_dtype(name)
    return resolve_precision(config, device_type).frozen


def resolve_run_dir(config: RunConfig, kind: str) -> Path:
    if config.trainer.run_dir:
        return Path(config.trainer.run_dir)
    return Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def setup_process(config: RunConfig, mapping: DeviceMapping, identity: ProcessIdentity,
                  device: torch.device) -> ProcessSetup:
    """Join the process group (several processes), build the role groups, pick dtype and seed the RNGs.

    `mapping` is the checked role -> rank mapping from the start-up checks; a split placement has
    already been refused there for trainers that cannot run one.
    """
    rank, world = identity.rank, identity.world_size
    roles = set(mapping.roles_on(rank))
    split = world > 1 and not mapping.is_colocated()
    dp_rank, dp_size = rank, world
    if split:  # a rollout rank's share of the prompts is among the rollout ranks (asynchronous RL)
        samplers = mapping.ranks("rollout") if "rollout" in roles else mapping.ranks("actor")
        dp_rank = samplers.index(rank) if rank in samplers else 0
        dp_size = len(samplers)
    tp = config.actor.tensor_parallel_size
    if tp > 1:  # (every role on the actor's ranks: the checks refuse others) a tensor-parallel group is one replica
        dp_rank, dp_size = rank // tp, world // tp
    groups = None
    # Under torchrun even one process joins a group and shards with FSDP2 (over NCCL on a GPU); one process
    # without torchrun joins a 1-rank group of its own when an fsdp option needs FSDP2 (mixed precision, the
    # default on a GPU; CPU offload), so fsdp.* means on 1 device what it means on 8 (`fsdp_launch`).
    launch = fsdp_launch(config, world_size=world, device_type=device.type)
    if world > 1 or os.environ.get("TORCHELASTIC_RUN_ID") or launch.own_group:
        if launch.own_group:
            init_single_process_group(device, config.devices.timeout_s, cpu_collectives=launch.offload)
        else:
            env = init_distributed(config.devices.timeout_s, use_gpu=config.trainer.device != "cpu",
                                   cpu_collectives=launch.offload)
            device = env.device if config.trainer.device != "cpu" else torch.device("cpu")
        groups = RoleGroups.create(mapping, timeout_s=config.devices.timeout_s, fsdp=config.fsdp,
                                   num_gpus_per_node=config.devices.num_gpus_per_node, device=device,
                                   sequence_parallel=config.actor.sequence_parallel_size, tensor_parallel=tp)
        start_heartbeat(config.devices.heartbeat_s, timeout_s=config.devices.timeout_s)  # 0 or 1 rank: none
    seed = config.trainer.seed
    seed_everything(seed)
    # Separate streams so that, e.g., validation sampling never shifts the training samples.
    # A rollout rank samples what the actor rank of the same index would (k = 0 reproduces a synchronous run); the
    # ranks of a tensor-parallel group sample the same tokens (their forwards are one forward), so as their replica.
    sampler = dp_rank if "rollout" in roles or tp > 1 else rank
    generator = torch.Generator(device=device).manual_seed(seed * 1000 + sampler)
    shuffle_generator = torch.Generator().manual_seed(seed + 1)
    return ProcessSetup(rank=rank, world_size=world, local_rank=identity.local_rank, device=device,
                        dtype=run_dtype(config.model.dtype, device.type), roles=roles, split=split,
                        dp_rank=dp_rank, dp_size=dp_size, generator=generator,
                        shuffle_generator=shuffle_generator, groups=groups,
                        frozen_dtype=frozen_dtype(config, device.type))


__all__ = ["ProcessIdentity", "ProcessSetup", "frozen_dtype", "resolve_device", "resolve_run_dir", "run_dtype",
           "seed_everything", "setup_process"]
