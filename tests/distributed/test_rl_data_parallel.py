"""The RL trainer on 2 gloo processes (FSDP2 actor, colocated roles), then resumed on 1 process."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from launch_support import metrics, verl_train  # pytest puts this folder on sys.path

from verl import RLTrainer
from verl.checkpoint import verify
from verl.config import load_config

pytestmark = pytest.mark.dist
HERE = Path(__file__).resolve().parent


def _config(tmp_path, steps):
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 5}},
        "data": {"train_batch_size": 4, "max_prompt_length": 16, "val_batch_size": 2},
        "rollout": {"n": 2, "max_new_tokens": 3},
        "actor": {"lr": 1e-3, "micro_batch_size": 2, "entropy_coef": 0.01},  # non-zero gradients
        "trainer": {"total_steps": steps, "device": "cpu", "run_dir": str(tmp_path / "run"),
                    "val_before_train": steps == 2, "cpu_threads": 1},
        "checkpoint": {"save_interval": 1},
        "reward": {"functions": [{"name": f"{HERE / 'row_reward.py'}:prompt_digits_reward"}]},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / f"cfg{steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_two_ranks_train_then_resume_on_one(tmp_path):
    verl_train(_config(tmp_path, 2), tmp_path, nproc=2)
    run = tmp_path / "run"
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]  # rank 0 logs, once per step (and the validation before)
    # the ranks answered 3 and 2 of the 5 held-out rows; their reduced score is one process's on all of them
    torch.manual_seed(0)
    one = RLTrainer(load_config(_config(tmp_path, 2)))
    assert rows[0]["val/score"] == pytest.approx(one.validate()["val/score"], abs=1e-9)
    rows = rows[1:]
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    step2 = run / "checkpoints" / "step_2"
    assert verify(step2) == []
    manifest = json.loads((step2 / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    # the sharded checkpoint loads into a single unsharded process (DCP reshards) and training continues
    verl_train(_config(tmp_path, 3), tmp_path)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert verify(run / "checkpoints" / "step_3") == []
