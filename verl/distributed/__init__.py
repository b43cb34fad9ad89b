"""Device mapping (roles -> rank groups), process groups, batch transfer and FSDP2 wrapping.

Start-up order for a trainer: validate_device_mapping (pure, before any model loads) ->
init_distributed -> RoleGroups.create (every rank) -> apply_fsdp per role -> move_batch between stages.
"""

from verl.distributed.fsdp import apply_fsdp, full_state_dict, load_full_state_dict
from verl.distributed.groups import RoleGroups
from verl.distributed.guard import CollectiveGuard
from verl.distributed.launch import build_torchrun_command, spawn_torchrun
from verl.distributed.mapping import ROLES, DeviceMapping, validate_device_mapping
from verl.distributed.memory import MemoryEstimate, estimate_memory
from verl.distributed.process import DistEnv, init_distributed

__all__ = [
    "ROLES",
    "DeviceMapping",
    "validate_device_mapping",
    "MemoryEstimate",
    "estimate_memory",
    "DistEnv",
    "init_distributed",
    "RoleGroups",
    "CollectiveGuard",
    "apply_fsdp",
    "full_state_dict",
    "load_full_state_dict",
    "spawn_torchrun",
    "build_torchrun_command",
]
