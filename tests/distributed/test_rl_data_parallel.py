"""The RL trainer on 2 gloo processes (FSDP2 actor, colocated roles), then resumed on 1 process."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from verl.checkpoint import verify

pytestmark = pytest.mark.dist


def _config(tmp_path, steps):
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 8}},
        "data": {"train_batch_size": 4, "max_prompt_length": 16},
        "rollout": {"n": 2, "max_new_tokens": 3},
        "actor": {"lr": 1e-3, "micro_batch_size": 2, "entropy_coef": 0.01},  # non-zero gradients
        "trainer": {"total_steps": steps, "device": "cpu", "run_dir": str(tmp_path / "run"),
                    "val_before_train": False, "cpu_threads": 1},
        "checkpoint": {"save_interval": 1},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / f"cfg{steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def test_two_ranks_train_then_resume_on_one(tmp_path):
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
          "-m", "verl.cli.main", "train", str(_config(tmp_path, 2))], tmp_path)
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # rank 0 logs, once per step
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    step2 = run / "checkpoints" / "step_2"
    assert verify(step2) == []
    manifest = json.loads((step2 / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    # the sharded checkpoint loads into a single unsharded process (DCP reshards) and training continues
    _run([sys.executable, "-m", "verl.cli.main", "train", str(_config(tmp_path, 3))], tmp_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert verify(run / "checkpoints" / "step_3") == []
