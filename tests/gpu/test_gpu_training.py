"""Training on CUDA: bf16 parameters; fp32 master weights with bf16 compute (`fsdp.mixed_precision`);
sdpa attention; FSDP2 over NCCL with one rank; gradient checkpointing; the collective guard's timeout
with an NCCL process group. Marked `gpu`; skipped where CUDA is absent. The multi-process parts run under
torchrun in subprocesses, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from verl.models.hf_loader import load_hf_model
from verl.models.tiny import build_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_nccl_guard_worker.py")


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


REWARD = """
def digit_share(prompt, response, ground_truth, **meta):
    return sum(c.isdigit() for c in response) / max(len(response), 1)
"""


def _rl_config(tmp_path: Path, **sections) -> Path:
    """GRPO on the tiny model with a dense reward (every step has a gradient). Shared with the CPU run of
    the one-rank FSDP worker (tests/distributed/test_one_rank_fsdp.py)."""
    (tmp_path / "reward.py").write_text(REWARD)
    cfg = {
        "model": {"path": "tiny", "dtype": "bfloat16"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 4}},
        "data": {"train_batch_size": 8, "max_prompt_length": 16},
        "rollout": {"n": 4, "max_new_tokens": 8},
        "reward": {"functions": [{"name": f"{tmp_path / 'reward.py'}:digit_share"}]},
        "actor": {"lr": 1e-4, "micro_batch_size": 8},
        "trainer": {"total_steps": 2, "device": "cuda", "run_dir": str(tmp_path / "run"),
                    "val_before_train": False},
        "logging": {"backends": ["jsonl"]},
    }
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _metrics(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_policy_loads_in_bf16_with_sdpa_on_cuda():
    model, _ = load_hf_model(build_tiny_model(), torch_dtype="bfloat16", device="cuda")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert next(model.parameters()).device.type == "cuda"
    assert model.config._attn_implementation == "sdpa"


def test_bf16_grpo_trains_on_one_gpu(tmp_path):
    cfg = _rl_config(tmp_path, model={"low_precision_master_weights": True})  # bf16 masters: refused otherwise
    _run([sys.executable, "-m", "verl.cli.main", "train", str(cfg)], tmp_path)
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["actor/grad_norm"] > 0 and r["rollout/logprob_diff_mean"] < 0.1


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_fsdp2_over_nccl_one_rank_fp32_master_bf16_compute(tmp_path, checkpointing):
    cfg = _rl_config(tmp_path, model={"dtype": "float32"},
                     fsdp={"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
                           "activation_checkpointing": checkpointing})
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                str(WORKER), "train", str(cfg)], tmp_path)
    report = json.loads((tmp_path / "fsdp_report.json").read_text())
    assert report["backend"] == "nccl" and report["fsdp"] is True, out.stdout[-2000:]
    assert report["param_dtypes"] == ["torch.float32"]  # fp32 master weights
    assert report["compute_dtype"] == "torch.bfloat16"  # bf16 forward under the mixed-precision policy
    assert report["checkpointed_layers"] == (2 if checkpointing else 0)
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in rows)


def test_default_precision_without_torchrun_is_fp32_master_bf16_compute(tmp_path):
    """`verl train cfg` on one GPU (no torchrun) with model.dtype=auto: a 1-rank NCCL group of its own, FSDP2
    with float32 master weights and bfloat16 compute (verl.trainer.precision)."""
    cfg = _rl_config(tmp_path, model={"dtype": "auto"})
    out = _run([sys.executable, str(WORKER), "train", str(cfg)], tmp_path)
    report = json.loads((tmp_path / "fsdp_report.json").read_text())
    assert report["backend"] == "nccl" and report["fsdp"] is True, out.stdout[-2000:]
    assert report["param_dtypes"] == ["torch.float32"] and report["compute_dtype"] == "torch.bfloat16"
    assert all(r["actor/grad_norm"] > 0 for r in _metrics(tmp_path))


def test_collective_guard_times_out_with_nccl(tmp_path):
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
          "guard", str(tmp_path)], tmp_path)
    msg = (tmp_path / "guard_timeout.txt").read_text()
    assert "collective timeout at stage 'ref_logprobs' (group [0, 1], call #0) on rank 0" in msg
    assert "rank(s) [1] did not arrive within 3s" in msg and "devices.timeout_s" in msg
