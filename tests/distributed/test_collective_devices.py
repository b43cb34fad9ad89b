"""Every collective of a split placement gets its tensors on the role's device (what NCCL needs), checked
on CPU/gloo with the marker device of tests/distributed/collective_check.py."""

import json
from pathlib import Path

import pytest
import yaml
from _collective_worker import worker
from _dist_workers import launch
from launch_support import verl_train

pytestmark = pytest.mark.dist


def test_split_placement_collectives_use_the_roles_device(tmp_path):
    launch(worker, 2, str(tmp_path))
    records = [json.loads((tmp_path / f"collectives{r}.json").read_text()) for r in (0, 1)]
    for record in records:
        assert record["checked"] > 0
        assert record["violations"] == []
        assert record["width"] == 4  # both actor ranks padded to the wider shard
        assert record["metrics"] == {"actor/y": 2.0, "critic/x": 1.0}
    assert records[0]["total"] == records[1]["total"] == pytest.approx((0 * 2 + 1 * 2) * 10)


@pytest.mark.slow
def test_a_split_placement_ppo_run_gives_collectives_the_roles_device(tmp_path):
    """The whole trainer (rollout, transfers, critic, metrics, stop flag, checkpoint) on 2 ranks: actor on
    both, critic on rank 1, under the check."""
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 2}},
        "data": {"train_batch_size": 2, "max_prompt_length": 16},
        "rollout": {"n": 2, "max_new_tokens": 3},
        "algorithm": {"adv_estimator": "gae", "kl_in_reward": True},
        "actor": {"micro_batch_size": 2},
        "critic": {"micro_batch_size": 2},
        "devices": {"actor": [0, 1], "critic": [1], "ref": [0]},
        "trainer": {"total_steps": 1, "run_dir": str(tmp_path / "run"), "val_before_train": False,
                    "cpu_threads": 1},
        "logging": {"backends": ["jsonl"]},
    }
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(cfg))
    verl_train(config, tmp_path, nproc=2, script=Path(__file__).with_name("checked_train.py"))
    for rank in (0, 1):
        record = json.loads((tmp_path / f"collectives_rank{rank}.json").read_text())
        assert record["checked"] > 0 and record["violations"] == [], record


@pytest.mark.slow
def test_sequence_parallel_collectives_get_the_actors_device(tmp_path):
    """`actor.sequence_parallel_size=2`: pooling the group's rows is checked. The attention's all-to-alls and
    the log-prob gather move the model's activations, which are where the model is (here made from FSDP2's
    gathered weights, which the check cannot mark): they are the only ones allowed through."""
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 2}},
        "data": {"train_batch_size": 2, "max_prompt_length": 16},
        "rollout": {"n": 2, "max_new_tokens": 3},
        "actor": {"micro_batch_size": 2, "kl_loss_coef": 0.1, "sequence_parallel_size": 2},
        "trainer": {"total_steps": 1, "run_dir": str(tmp_path / "run"), "val_before_train": False,
                    "cpu_threads": 1},
        "logging": {"backends": ["jsonl"]},
    }
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(cfg))
    verl_train(config, tmp_path, nproc=2, script=Path(__file__).with_name("checked_train.py"))
    for rank in (0, 1):
        record = json.loads((tmp_path / f"collectives_rank{rank}.json").read_text())
        assert record["checked"] > 0, record
        others = [v for v in record["violations"] if " at verl.distributed.sequence_parallel:" not in v]
        assert others == [], record
