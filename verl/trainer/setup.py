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
from verl.errors import ConfigError
from verl.utils.dtype import resolve_dtype


@dataclass
class ProcessSetup:
    """Everything a trainer knows about its process before any model loads."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dtype: torch.dtype
    roles: set[str]
    split: bool
    dp_rank: int
    dp_size: int
    generator: torch.Generator
    shuffle_generator: torch.Generator
    groups: Any = None


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
    """`model.dtype` as a run loads it; 'auto' is bfloat16 on a GPU that supports it, else float32.

    The one place 'auto' is resolved, so `verl check` estimates memory and loads the model in the dtype
    the trainer will use.
    """
    if name == "auto":
        bf16 = device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return resolve_dtype(name)


def resolve_run_dir(config: RunConfig, kind: str) -> Path:
    if config.trainer.run_dir:
        return Path(config.trainer.run_dir)
    return Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"


def setup_process(config: RunConfig, mapping: Any, identity: ProcessIdentity, device: torch.device) -> ProcessSetup:
    """Join the process group (several processes), build the role groups, pick dtype and seed the RNGs.

    `mapping` is the checked role -> rank mapping from the start-up checks; a split placement has
    already been refused there for trainers that cannot run one.
    """
    rank, world = identity.rank, identity.world_size
    roles = set(mapping.roles_on(rank))
    split = world > 1 and not mapping.is_colocated()
    dp_rank, dp_size = rank, world
    if split:
        actor_ranks = mapping.ranks("actor")
        dp_rank = actor_ranks.index(rank) if rank in actor_ranks else 0
        dp_size = len(actor_ranks)
    groups = None
    # Under torchrun even one process joins a group and shards with FSDP2 (over NCCL on a GPU), so that
    # fsdp.mixed_precision / activation_checkpointing / cpu_offload mean on 1 GPU what they mean on 8.
    if world > 1 or os.environ.get("TORCHELASTIC_RUN_ID"):
        env = init_distributed(config.devices.timeout_s, use_gpu=config.trainer.device != "cpu",
                               cpu_collectives=config.fsdp.cpu_offload)
        device = env.device if config.trainer.device != "cpu" else torch.device("cpu")
        groups = RoleGroups.create(mapping, timeout_s=config.devices.timeout_s, fsdp=config.fsdp,
                                   num_gpus_per_node=config.devices.num_gpus_per_node, device=device)
    seed = config.trainer.seed
    seed_everything(seed)
    # Separate streams so that, e.g., validation sampling never shifts the training samples.
    generator = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    shuffle_generator = torch.Generator().manual_seed(seed + 1)
    return ProcessSetup(rank=rank, world_size=world, local_rank=identity.local_rank, device=device,
                        dtype=run_dtype(config.model.dtype, device.type), roles=roles, split=split,
                        dp_rank=dp_rank, dp_size=dp_size, generator=generator,
                        shuffle_generator=shuffle_generator, groups=groups)


__all__ = ["ProcessIdentity", "ProcessSetup", "resolve_device", "resolve_run_dir", "run_dtype", "seed_everything",
           "setup_process"]
