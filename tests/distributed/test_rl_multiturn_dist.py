"""Multi-turn RL on 2 gloo processes: episodes of different lengths on each rank are padded to one width
(response, attention mask and sampler log-probs) and train with the FSDP2 actor."""

import json
from pathlib import Path

import pytest
import yaml
from launch_support import metrics, verl_train  # pytest puts this folder on sys.path

from verl.checkpoint import verify

pytestmark = pytest.mark.dist

ENV = Path(__file__).resolve().parents[1] / "trainer" / "multiturn_env.py"


def test_two_ranks_train_on_episodes(tmp_path):
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": f"{ENV}:ToolEnv"},
        "data": {"train_batch_size": 4, "max_prompt_length": 16},
        "rollout": {"n": 2, "max_new_tokens": 6, "stop": ["e", "a"]},
        "actor": {"lr": 1e-3, "micro_batch_size": 2, "ppo_epochs": 2, "entropy_coef": 0.01},  # non-zero gradients
        "trainer": {"total_steps": 2, "device": "cpu", "run_dir": str(tmp_path / "run"), "val_every": 2,
                    "val_before_train": False, "cpu_threads": 1},
        "checkpoint": {"save_interval": 2},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    verl_train(path, tmp_path, nproc=2)
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["actor/grad_norm"] > 0 and r["episode/tool_calls_mean"] > 0
        assert r["rollout/logprob_diff_max"] < 1e-5  # the old log-probs equal the sampler's on model tokens
    assert "val/score" in rows[1] and "val/episode/turns_mean" in rows[1]
    step2 = tmp_path / "run" / "checkpoints" / "step_2"
    assert verify(step2) == []
    assert json.loads((step2 / "manifest.json").read_text())["world_size"] == 2
