"""Preemption on several ranks: SIGTERM reaching only one of two ranks stops both after the same step,
both save that step's checkpoint, and both exit with the signal's status and a resume hint (no hang)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from verl.checkpoint import list_checkpoints

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 2}},
        "data": {"train_batch_size": 2, "max_prompt_length": 16},
        "rollout": {"n": 2, "max_new_tokens": 2},
        "actor": {"micro_batch_size": 2},
        "devices": {"timeout_s": 60},
        "trainer": {"total_steps": 4, "device": "cpu", "run_dir": str(tmp_path / "run"),
                    "val_before_train": False, "val_every": 0, "cpu_threads": 1},
        "checkpoint": {"save_interval": 0},
        "logging": {"backends": ["jsonl"]},
    }
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(cfg))
    script = Path(__file__).with_name("preempt_one_rank_train.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    try:  # before the all-reduced flag: rank 1 waited in the checkpoint, rank 0 in step 2, for ever
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              str(script), str(config)], capture_output=True, text=True, timeout=300, env=env,
                             cwd=tmp_path)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the ranks hung after SIGTERM reached one of them:\n{(exc.stdout or b'')[-3000:]!r}")
    log = out.stdout + out.stderr
    assert out.returncode != 0, log[-3000:]
    for rank in (0, 1):  # both stopped after step 1 with the signal's reason and how to go on
        assert f"rank {rank}: interrupted at step 1/4 (SIGTERM); saved" in log, log[-3000:]
    assert "rerun the same command to resume" in log
    assert [c.step for c in list_checkpoints(tmp_path / "run")] == [1]  # one checkpoint, saved by both
    step1 = tmp_path / "run" / "checkpoints" / "step_1"
    assert json.loads((step1 / "manifest.json").read_text())["world_size"] == 2
    files = json.loads((step1 / "manifest.json").read_text())["files"]
    assert {f"extra/rank_{r:05d}.pt" for r in (0, 1)} <= set(files)
