"""Colocated vLLM on real GPUs: GRPO with rollout.engine=vllm under torchrun (2 ranks on 2 GPUs, else 1), each
rank's engine on its own GPU (external_launcher), asleep at level 2 during the update, woken and re-loaded
with the policy's weights before every rollout, returning the log-probs of the tempered distribution it
sampled from. Asynchronous RL with vLLM on a rollout rank of its own (2 GPUs: actor on 0, rollout on 1), fed
by the actor's weight deliveries. Marked `gpu`; skipped without CUDA or without vllm. The CPU tests of the same
protocol run against a stand-in (tests/rollout/test_vllm_sync.py, tests/rollout/test_vllm_async.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from verl.models.tiny import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (pip install vllm)"),
]

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, **sections: dict) -> Path:
    # head_dim 64: a size every vLLM attention backend supports (the default tiny model has 16)
    model = build_tiny_model(tmp_path / "model", hidden_size=256, num_heads=4, num_kv_heads=2)
    cfg = {
        "model": {"path": model, "dtype": "bfloat16"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 4}},
        "data": {"train_batch_size": 8, "max_prompt_length": 32},
        "rollout": {"engine": "vllm", "n": 4, "max_new_tokens": 8, "temperature": 0.8,
                    "vllm": {"gpu_memory_utilization": 0.25, "max_model_len": 64, "enforce_eager": True}},
        "actor": {"lr": 1e-4, "micro_batch_size": 8},
        "trainer": {"total_steps": 3, "device": "cuda", "run_dir": str(tmp_path / "run"),
                    "val_before_train": False},
        "logging": {"backends": ["jsonl"]},
    }
    for name, section in sections.items():
        cfg[name] = {**cfg.get(name, {}), **section}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_colocated_vllm_grpo_follows_the_policy(tmp_path):
    nproc = min(2, torch.cuda.device_count())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "verl.cli.main", "train", str(_config(tmp_path))]
    out = subprocess.run(args, capture_output=True, text=True, timeout=420, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # bf16 vLLM vs the trainer's forward: processed (tempered) log-probs agree closely
        assert r["actor/grad_norm"] > 0
        assert r["rollout/logprob_diff_mean"] < 0.05, r


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL takes one GPU per rank)")
def test_async_vllm_rollout_rank_takes_every_delivery(tmp_path):
    """Rank 0 trains, rank 1 samples with vLLM one step ahead (max_staleness=1): the deliveries (bucketed NCCL
    broadcasts) are loaded into the rollout rank's awake engine, which samples from the actor's weights."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    config = _config(tmp_path, devices={"actor": [0], "rollout": [1]}, trainer={"total_steps": 2},
                     rollout={"max_staleness": 1})
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "-m", "verl.cli.main", "train", str(config)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=420, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["actor/grad_norm"] > 0 and r["async/weight_delivery_mb"] > 0 and r["async/staleness"] <= 1
        assert r["rollout/logprob_diff_mean"] < 0.05, r  # lr 1e-4: one update old moves the log-probs little


def test_colocated_vllm_grpo_with_image_prompts(tmp_path):
    """A vision-language policy on vLLM: the shapes demo's pictures go in vLLM's multimodal format (one image pad
    per image, the PIL images; verl.rollout.vllm_images), and the engine's log-probs follow the policy's."""
    from verl.models.tiny_vl import build_tiny_vl_model

    # head dims of 64 in the language model and the vision tower: sizes every vLLM attention backend supports
    model = build_tiny_vl_model(tmp_path / "vl", hidden_size=256, num_heads=4, num_kv_heads=2, vision_hidden_size=128,
                                vision_heads=2)
    config = _config(tmp_path, model={"path": model, "dtype": "bfloat16"},
                     env={"name": "shapes", "kwargs": {"grid": 2, "max_count": 3, "num_train": 64, "num_val": 4}},
                     data={"max_prompt_length": 64}, trainer={"total_steps": 2},
                     rollout={"max_new_tokens": 3, "vllm": {"gpu_memory_utilization": 0.25, "max_model_len": 128,
                                                            "enforce_eager": True}})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "verl.cli.main", "train", str(config)]
    out = subprocess.run(args, capture_output=True, text=True, timeout=420, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_mean"] < 0.05, r
