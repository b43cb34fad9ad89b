"""`actor.cpu_offload` / `critic.cpu_offload` / `fsdp.cpu_offload` under FSDP2 on 2 gloo ranks: the
CPUOffloadPolicy is applied and gives the same gradients and the same weights after an AdamW step as
without it (bit for bit)."""

import _dist_workers as W  # noqa: E402 - pytest puts tests/distributed on sys.path
import pytest
import torch

pytestmark = pytest.mark.dist


def test_cpu_offload_gives_the_same_gradients_and_step(tmp_path):
    W.launch(W.offload_worker, 2, str(tmp_path))
    for rank in range(2):
        result = torch.load(tmp_path / f"offload{rank}.pt", weights_only=False)
        off, on = result[False], result[True]
        assert on["offloads"] is True and off["offloads"] is False
        assert on["grads"].keys() == off["grads"].keys()
        assert sum(float(g.abs().sum()) for g in off["grads"].values()) > 0
        for name, g in off["grads"].items():
            assert torch.equal(on["grads"][name], g), name
        for name, w in off["weights"].items():
            assert torch.equal(on["weights"][name], w), name
