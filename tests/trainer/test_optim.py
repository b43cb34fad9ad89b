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


def test_a_zero_gradient_skips_the_step_where_adamw_would_move_every_weight():
    """AdamW on a zero gradient still moves weights by momentum and weight decay (after a collapse, for ~10
    steps, with no reward spread at all); `clip_and_step` skips such a step, so the next real step is the one
    AdamW written out gives with the zero-gradient step left out."""
    from types import SimpleNamespace

    from verl.trainer.compose.runtime import TrainerRuntime

    torch.manual_seed(0)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
    p0 = torch.randn(6, 4, dtype=torch.float64)
    g1, g2 = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    module = torch.nn.Linear(4, 6, bias=False).double()
    module.weight.data.copy_(p0)
    optimizer, scheduler = build_optimizer(list(module.parameters()), cfg, total_steps=3)
    runtime = SimpleNamespace(step_count=0)
    steps = []
    for g in (g1, torch.zeros_like(g1), g2):
        module.weight.grad = g.clone()
        before = module.weight.detach().clone()
        steps.append(TrainerRuntime.clip_and_step(runtime, module, optimizer, 1e9, scheduler))
        if not g.any():
            assert torch.equal(module.weight.detach(), before)  # no momentum step, no weight decay
            assert module.weight.grad is None
    assert steps[1] == 0.0 and steps[0] > 0 and steps[2] > 0
    assert float(optimizer.state[module.weight]["step"]) == 2
    assert scheduler.last_epoch == 2  # the schedule counts optimizer steps
    want = _adamw_reference(p0, [g1, g2], cfg.lr, cfg.betas, 1e-8, cfg.weight_decay)
    assert torch.allclose(module.weight.detach(), want, rtol=0, atol=1e-12)
    # what stepping on the zero gradient would have given instead: a different weight
    stepped = _adamw_reference(p0, [g1, torch.zeros_like(g1), g2], cfg.lr, cfg.betas, 1e-8, cfg.weight_decay)
    assert (stepped - want).abs().max() > 1e-4
