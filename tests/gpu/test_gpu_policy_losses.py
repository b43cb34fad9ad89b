"""Every registered policy loss on CUDA, forward and backward, without a host sync (the update keeps its
metrics on the device until the step's end). Marked `gpu`; skipped where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from verl.algorithms import AGG_MODES
from verl.algorithms.policy_losses import POLICY_LOSSES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_runs_on_cuda_without_a_host_sync(name, agg):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    old = -torch.rand(8, 32, device=dev, generator=g) * 3
    logp = (old + 0.2 * torch.randn(8, 32, device=dev, generator=g)).requires_grad_(True)
    adv = torch.randn(8, 1, device=dev, generator=g).expand(8, 32).contiguous()
    mask = (torch.arange(32, device=dev) < torch.randint(1, 33, (8, 1), device=dev, generator=g)).float()
    weights = torch.rand(8, 32, device=dev, generator=g) + 0.5
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, stats = POLICY_LOSSES[name](logp, old, adv, mask, agg=agg, norm_len=32, token_weights=weights,
                                          generator=g)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(v.device.type == "cuda" and v.dim() == 0 for v in stats.values())
