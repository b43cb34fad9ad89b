"""`verl check` (the trainer's start-up pass) refuses rollout.engine=vllm where it cannot run: without a CUDA
device or without the vllm package, each with its fix, before anything loads."""

import importlib.util

import pytest

from verl.cli.main import main
from verl.demos.arithmetic import demo_config_path
from verl.errors import ConfigError
from verl.rollout.engine_check import check_rollout_engine

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here")
def test_check_refuses_vllm_on_cpu_without_vllm(capsys):
    assert main(["check", demo_config_path(), "rollout.engine=vllm", "trainer.device=cpu"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "rollout.engine=vllm needs a CUDA GPU, but this run is on 'cpu'" in out
    assert "rollout.engine=vllm but the vllm package is not installed" in out
    assert "Fix: pip install vllm (on the GPU node), or set rollout.engine=hf" in out
    assert "verl[" not in out
    assert "skipped: the start-up problems come first: nothing was loaded" in out


def test_engine_check_each_condition(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # "installed"
    assert check_rollout_engine("vllm", device_type="cuda") == []
    assert check_rollout_engine("hf", device_type="cpu") == []
    [cpu] = check_rollout_engine("vllm", device_type="cpu")
    assert isinstance(cpu, ConfigError) and "needs a CUDA GPU" in str(cpu) and "rollout.engine=hf" in str(cpu)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    [missing] = check_rollout_engine("vllm", device_type="cuda")
    assert "pip install vllm" in str(missing) and "verl[" not in str(missing)
