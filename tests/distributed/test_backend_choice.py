"""The process group's backend fits the tensors its collectives get: NCCL refuses CPU tensors, so a GPU
run with CPU offload (FSDP2 reduces the offloaded gradients' norms on the CPU) gets gloo for CPU tensors
beside NCCL, and trainer.device=cpu on a GPU machine gets gloo. (CUDA is simulated: the choice is tested,
not NCCL.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import verl.trainer.build.setup as setup_mod
from verl.config import load_config
from verl.distributed import process
from verl.trainer.build.setup import ProcessIdentity, setup_process


@pytest.fixture
def fake_gpu_launch(monkeypatch):
    """A torchrun worker on a machine with one GPU; init_process_group records its arguments."""
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    return calls


@pytest.mark.parametrize("kwargs, backend, device", [
    ({}, "nccl", "cuda"),
    ({"cpu_collectives": True}, "cpu:gloo,cuda:nccl", "cuda"),
    ({"use_gpu": False}, "gloo", "cpu"),
])
def test_backend_fits_the_tensors(fake_gpu_launch, kwargs, backend, device):
    env = process.init_distributed(60, **kwargs)
    assert fake_gpu_launch[-1]["backend"] == env.backend == backend
    assert env.device.type == device


@pytest.mark.parametrize("overrides, wanted", [
    ([], {"use_gpu": True, "cpu_collectives": False}),
    (["fsdp.cpu_offload=true"], {"use_gpu": True, "cpu_collectives": True}),
    (["trainer.device=cpu"], {"use_gpu": False, "cpu_collectives": False}),
])
def test_trainer_asks_for_the_backend_its_settings_need(monkeypatch, overrides, wanted):
    seen = {}

    class Joined(Exception):
        pass

    def init(timeout_s, **kwargs):
        seen.update(kwargs)
        raise Joined

    monkeypatch.setattr(setup_mod, "init_distributed", init)
    config = load_config(None, ["model.path=tiny", *overrides])
    mapping = type("M", (), {"roles_on": lambda self, r: ["actor"], "is_colocated": lambda self: True})()
    with pytest.raises(Joined):
        setup_process(config, mapping, ProcessIdentity(0, 2, 0), torch.device("cpu"))
    assert seen == wanted
