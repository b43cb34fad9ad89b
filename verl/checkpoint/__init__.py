"""Atomic, verified checkpoints on torch.distributed.checkpoint, exact resume and Hugging Face export.

See ``verl.checkpoint.manager`` for the on-disk layout and the commit protocol.
"""

from verl.checkpoint.hf_export import export_hf
from verl.checkpoint.manager import (
    CheckpointHandle,
    CheckpointInfo,
    CheckpointManager,
    list_checkpoints,
    load_checkpoint,
)
from verl.checkpoint.manifest import verify
from verl.checkpoint.rng import capture_rng_state, restore_rng_state
from verl.checkpoint.signals import GracefulStop, TrainingInterrupted

__all__ = [
    "CheckpointManager",
    "CheckpointHandle",
    "CheckpointInfo",
    "list_checkpoints",
    "load_checkpoint",
    "verify",
    "export_hf",
    "capture_rng_state",
    "restore_rng_state",
    "GracefulStop",
    "TrainingInterrupted",
]
