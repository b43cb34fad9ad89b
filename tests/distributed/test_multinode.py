"""Two nodes on one machine: two `verl train --nproc 2 --nnodes 2` agents meet at a c10d rendezvous on
localhost, as two real nodes would, and run a split-placement PPO job (the actor's ranks and the critic's
ranks on different nodes), checkpoint, then resume with the same two commands."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from launch_support import free_port, metrics  # pytest puts this folder on sys.path

from verl.checkpoint import verify

pytestmark = [pytest.mark.dist, pytest.mark.slow]


REWARD = """
def digit_share(prompt, response, ground_truth, **meta):
    return sum(c.isdigit() for c in response) / max(len(response), 1)
"""


def _config(tmp_path, steps):
    (tmp_path / "reward.py").write_text(REWARD)  # dense: every step has something to learn
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 2}},
        "data": {"train_batch_size": 4, "max_prompt_length": 16},
        "rollout": {"n": 2, "max_new_tokens": 3},
        "reward": {"functions": [{"name": f"{tmp_path / 'reward.py'}:digit_share"}]},
        "algorithm": {"adv_estimator": "gae"},
        "actor": {"lr": 1e-3, "micro_batch_size": 2},
        "critic": {"lr": 1e-3, "micro_batch_size": 2},
        "devices": {"actor": [0, 1], "critic": [2, 3], "ref": [0]},
        "trainer": {"total_steps": steps, "device": "cpu", "run_dir": str(tmp_path / "run"),
                    "val_before_train": False, "cpu_threads": 1},
        "checkpoint": {"save_interval": 1},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / f"cfg{steps}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _two_nodes(tmp_path, steps, *, config=None, nproc=2):
    """The two commands a user types on node 0 and node 1, started together."""
    config, endpoint = config or _config(tmp_path, steps), f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "verl.cli.main", "train", str(config), "--nproc", str(nproc), "--nnodes", "2",
         "--node-rank", str(node), "--rdzv-endpoint", endpoint],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path) for node in (0, 1)]
    outputs = []
    for agent in agents:
        try:
            out, _ = agent.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            for a in agents:
                a.kill()
            raise
        outputs.append(out)
    for node, (agent, out) in enumerate(zip(agents, outputs, strict=True)):
        assert agent.returncode == 0, f"node {node}:\n{out[-5000:]}"
    return metrics(tmp_path / "run")


def test_two_node_split_placement_trains_and_resumes(tmp_path):
    rows = _two_nodes(tmp_path, 2)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # actor metrics from one node's ranks, critic metrics from the other's
        assert r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0
    step2 = tmp_path / "run" / "checkpoints" / "step_2"
    assert verify(step2) == []
    manifest = json.loads((step2 / "manifest.json").read_text())
    assert manifest["world_size"] == 4
    assert {"model", "optimizer", "critic", "critic_optimizer"} <= set(manifest["app_state_keys"])

    rows = _two_nodes(tmp_path, 3)  # the same two commands with more steps resume at step 3
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["critic/grad_norm"] > 0
    assert verify(tmp_path / "run" / "checkpoints" / "step_3") == []


def test_two_nodes_of_one_gpu_each_are_accepted(tmp_path):
    """devices.num_gpus_per_node=1 on 2 nodes: each launcher checks 2 processes as 1 per node (it has no
    LOCAL_WORLD_SIZE to infer that from; --nnodes says it), and both workers train."""
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 2}},
        "data": {"train_batch_size": 2, "max_prompt_length": 16},
        "rollout": {"n": 2, "max_new_tokens": 2},
        "actor": {"micro_batch_size": 2},
        "devices": {"num_gpus_per_node": 1},
        "trainer": {"total_steps": 1, "device": "cpu", "run_dir": str(tmp_path / "run"),
                    "val_before_train": False, "cpu_threads": 1},
        "checkpoint": {"save_interval": 0},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / "one_gpu_per_node.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rows = _two_nodes(tmp_path, 1, config=path, nproc=1)
    assert [r["step"] for r in rows] == [1]
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step_1" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
