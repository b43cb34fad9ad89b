"""The optimizer recipe: fused AdamW where it applies, checked against AdamW written out in float64."""

from __future__ import annotations

import math

import torch

from verl.config.schema import OptimConfig
from verl.trainer.build.optim import build_optimizer


def _adamw_reference(p0, grads, lr, betas, eps, wd):
    """Decoupled weight decay Adam (Loshchilov & Hutter), bias-corrected, in float64."""
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    return p


def test_plain_tensors_get_the_fused_kernel_and_match_adamw_written_out():
    torch.manual_seed(0)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
    p0 = torch.randn(7, 5, dtype=torch.float64)
    grads = [torch.randn(7, 5, dtype=torch.float64) for _ in range(4)]
    param = torch.nn.Parameter(p0.clone())
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    optimizer, _ = build_optimizer([param, frozen], cfg, total_steps=4)
    assert optimizer.defaults["fused"] is True
    assert len(optimizer.param_groups[0]["params"]) == 1  # frozen parameters are not optimised
    for g in grads:
        param.grad = g.clone()
        optimizer.step()
    want = _adamw_reference(p0, grads, cfg.lr, cfg.betas, 1e-8, cfg.weight_decay)
    assert torch.allclose(param.detach(), want, rtol=0, atol=1e-12)
    assert not math.isclose(float((param.detach() - p0).abs().max()), 0.0)
