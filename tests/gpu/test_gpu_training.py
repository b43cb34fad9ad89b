"""Training on CUDA: bf16 parameters; fp32 master weights with bf16 compute (`fsdp.mixed_precision`);
sdpa attention; FSDP2 over NCCL with one rank; gradient checkpointing; weights that move at lr 1e-6 in the
default precision; CPU offload; GRPO with a KL loss split over 2 GPUs (skipped on one); the collective
guard's timeout with an NCCL process group. Marked `gpu`; skipped where CUDA is absent. The multi-process parts run
under torchrun in subprocesses, as a user runs them."""

from __future__ import annotations

import json
import math
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


def _run(args: list[str], cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
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
    assert "nccl" in report["backend"] and report["fsdp"] is True, out.stdout[-2000:]
    assert report["param_dtypes"] == ["torch.float32"]  # fp32 master weights
    assert report["compute_dtype"] == "torch.bfloat16"  # bf16 forward under the mixed-precision policy
    assert report["checkpointed_layers"] == (2 if checkpointing else 0)
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in rows)


@pytest.mark.parametrize("precision", ["default", "bf16-masters"])
def test_weights_move_at_lr_1e6_with_the_default_precision(tmp_path, precision):
    """One GRPO step at actor.lr=1e-6 as `verl train cfg` runs it on one GPU (no torchrun: a 1-rank NCCL group
    of its own). model.dtype=auto holds float32 master weights and computes in bfloat16 (FSDP2
    MixedPrecisionPolicy, verl.trainer.build.precision), so AdamW's first step (about lr per weight) moves nearly
    every weight; bfloat16 masters (the old default, now only on insisting) round most of those steps away.
    The same two runs over gloo on CPU: tests/distributed/test_one_rank_fsdp.py."""
    model = ({"dtype": "auto"} if precision == "default"
             else {"dtype": "bfloat16", "low_precision_master_weights": True})
    cfg = _rl_config(tmp_path, model=model, actor={"lr": 1e-6}, trainer={"total_steps": 1})
    out = _run([sys.executable, str(WORKER), "train", str(cfg), "moved"], tmp_path)
    report = json.loads((tmp_path / "fsdp_report.json").read_text())
    assert "nccl" in report["backend"] and report["fsdp"] is True, out.stdout[-2000:]
    assert report["compute_dtype"] == "torch.bfloat16"
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1] and rows[0]["actor/grad_norm"] > 0
    moved = json.loads((tmp_path / "probe_rank0.json").read_text())["moved_share"]
    if precision == "default":
        assert report["param_dtypes"] == ["torch.float32"]
        assert moved > 0.99, f"only {moved:.2%} of the actor's weights changed in one step at lr 1e-6"
    else:
        assert report["param_dtypes"] == ["torch.bfloat16"]
        assert moved < 0.10, f"{moved:.2%} of the bf16 weights changed: expected most updates rounded away"


def test_cpu_offload_keeps_the_shards_on_the_cpu_between_steps(tmp_path):
    """`fsdp.cpu_offload=true` on one GPU (no torchrun: FSDP2 on a 1-rank group of its own, CPUOffloadPolicy):
    2 steps train, and between steps the actor's local shards and AdamW states live on the CPU."""
    cfg = _rl_config(tmp_path, model={"dtype": "auto"}, fsdp={"cpu_offload": True})
    out = _run([sys.executable, str(WORKER), "train", str(cfg)], tmp_path)
    report = json.loads((tmp_path / "fsdp_report.json").read_text())
    assert report["fsdp"] is True and "nccl" in report["backend"], out.stdout[-2000:]
    assert report["param_dtypes"] == ["torch.float32"] and report["compute_dtype"] == "torch.bfloat16"
    probe = json.loads((tmp_path / "probe_rank0.json").read_text())
    assert probe["steps"] == [{"params": ["cpu"], "optimizer": ["cpu"]}] * 2
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in rows)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpu_grpo_with_a_kl_loss_and_the_reference_on_its_own_gpu(tmp_path):
    """GRPO with a KL loss on 2 GPUs over NCCL, split: the actor (FSDP2, fp32 masters, bf16 compute) on rank 0,
    the frozen reference on rank 1; the sequences go to rank 1 and the reference log-probs come back.
    The CPU/gloo version of split placements: tests/distributed/test_rl_split.py."""
    cfg = _rl_config(tmp_path, model={"dtype": "auto"}, actor={"kl_loss_coef": 0.1},
                     devices={"actor": [0], "ref": [1]})
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                str(WORKER), "train", str(cfg)], tmp_path)
    actor, ref = (json.loads((tmp_path / f"probe_rank{r}.json").read_text()) for r in (0, 1))
    assert "nccl" in actor["backend"] and "nccl" in ref["backend"], out.stdout[-2000:]
    assert (actor["cuda_device"], ref["cuda_device"]) == (0, 1)
    assert actor["holds_actor"] and actor["ref_devices"] is None and "ref" not in actor["roles"]
    assert not ref["holds_actor"] and ref["ref_devices"] == ["cuda"] and "ref" in ref["roles"]
    assert actor["steps"] == [{"params": ["cuda"], "optimizer": ["cuda"]}] * 2
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["actor/grad_norm"] > 0
        assert math.isfinite(r["actor/kl_loss"]) and math.isfinite(r["actor/ref_kl"])
    assert rows[1]["actor/kl_loss"] > 0  # after one update the actor has left the reference


def test_collective_guard_times_out_with_nccl(tmp_path):
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
          "guard", str(tmp_path)], tmp_path)
    msg = (tmp_path / "guard_timeout.txt").read_text()
    assert "collective timeout at stage 'ref_logprobs' (group [0, 1], call #0) on rank 0" in msg
    assert "rank(s) [1] did not arrive within 3s" in msg and "devices.timeout_s" in msg
