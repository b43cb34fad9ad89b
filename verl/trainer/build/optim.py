"""AdamW with linear warm-up then a constant or cosine schedule: the one optimizer recipe all trainers use."""

from __future__ import annotations

import math

import torch

from verl.config.schema import OptimConfig


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def implementation(params: list[torch.Tensor]) -> dict[str, bool]:
    """The fused AdamW kernel where it applies: plain (not FSDP-sharded) floating-point tensors on CPU or
    CUDA. It updates every parameter in one kernel instead of a Python loop of small ops (figures from
    benchmarks/adamw.py in docs/performance.md). Sharded DTensors keep torch's default (foreach on GPUs)."""
    from torch.distributed.tensor import DTensor

    plain = all(not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda")
                and p.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16) for p in params)
    return {"fused": True} if params and plain else {}


def build_optimizer(
    params, cfg: OptimConfig, *, total_steps: int, lr: float | None = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    trainable = [p for p in params if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr or cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                                  **implementation(trainable))

    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
                         schedule=cfg.lr_schedule, min_lr_ratio=cfg.min_lr_ratio)

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
