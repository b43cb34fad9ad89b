"""One process under torchrun joins a process group and shards the policy with FSDP2, so
`fsdp.mixed_precision` (fp32 master weights, bf16 compute) and `fsdp.activation_checkpointing` take effect
on a single device. On CPU this runs over gloo; tests/gpu/test_gpu_training.py runs the same worker over NCCL."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from test_gpu_training import ROOT, WORKER, _rl_config  # noqa: E402

pytestmark = pytest.mark.dist


def test_one_rank_under_torchrun_shards_with_mixed_precision_and_checkpointing(tmp_path):
    cfg = _rl_config(tmp_path, model={"dtype": "float32"}, rollout={"n": 2, "max_new_tokens": 4},
                     data={"train_batch_size": 4}, actor={"micro_batch_size": 4},
                     trainer={"device": "cpu", "cpu_threads": 1},
                     fsdp={"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
                           "activation_checkpointing": True})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                          str(WORKER), "train", str(cfg)], capture_output=True, text=True, timeout=600, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads((tmp_path / "fsdp_report.json").read_text())
    assert report == {"backend": "gloo", "fsdp": True, "param_dtypes": ["torch.float32"],
                      "compute_dtype": "torch.bfloat16", "checkpointed_layers": 2}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in rows)


def _moved_share_of_one_step(tmp_path: Path, model: dict) -> float:
    """One GRPO step at lr 1e-6, one process without torchrun (a 1-rank gloo group of its own), bf16 compute."""
    cfg = _rl_config(tmp_path, model=model, actor={"lr": 1e-6, "micro_batch_size": 4},
                     rollout={"n": 2, "max_new_tokens": 4}, data={"train_batch_size": 4},
                     trainer={"device": "cpu", "cpu_threads": 1, "total_steps": 1},
                     fsdp={"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(WORKER), "train", str(cfg), "moved"], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["actor/grad_norm"] > 0
    return json.loads((tmp_path / "probe_rank0.json").read_text())["moved_share"]


@pytest.mark.slow
def test_float32_masters_move_at_lr_1e6_through_the_trainer_and_bf16_masters_do_not(tmp_path):
    """The CPU twin of tests/gpu/test_gpu_training.py::test_weights_move_at_lr_1e6_with_the_default_precision:
    the same worker and measure (the share of the actor's weight elements one step changes) over gloo."""
    (tmp_path / "fp32").mkdir()
    (tmp_path / "bf16").mkdir()
    assert _moved_share_of_one_step(tmp_path / "fp32", {"dtype": "float32"}) > 0.99
    assert _moved_share_of_one_step(tmp_path / "bf16",
                                    {"dtype": "bfloat16", "low_precision_master_weights": True}) < 0.10
