"""GRPO with a KL loss and `actor.tensor_parallel_size=2` (`verl train` on gloo processes, as a user launches it)
against the same run without tensor parallelism.

The ranks of a tensor-parallel group read the same prompts and sample with their replica's generator, so TP=2 on
2 ranks samples what one process samples, and TP=2 x DP=2 on 4 ranks what DP=2 on 2 ranks does. Step 1 runs
before any optimizer step: its losses, entropy and gradient norm differ only by the rounding of the split
matmuls and the vocabulary-parallel log-softmax (1e-5), its rewards not at all, and its KL loss is exactly 0 on
both sides (the tensor-parallel reference equals the tensor-parallel policy bit for bit). After an optimizer step
Adam turns those 1e-7 gradient differences into weight differences of up to `lr` on near-zero gradients, which can
flip a sampled token on another CPU (issue 42): steps 2 and 3 are only checked to have run, with a KL loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from launch_support import metrics, verl_train  # pytest puts this folder on sys.path

pytestmark = pytest.mark.dist
HERE = Path(__file__).resolve().parent
STEP1 = ("actor/pg_loss", "actor/entropy", "actor/grad_norm")


def _config(tmp_path: Path, name: str, tp: int) -> Path:
    cfg = {
        "model": {"path": "tiny", "dtype": "float32"},  # 4 heads, 2 key/value heads, intermediate 256: TP=2 splits
        "env": {"name": "arithmetic", "kwargs": {"max_operand": 9, "num_val": 4}},
        "data": {"train_batch_size": 2, "max_prompt_length": 16, "val_batch_size": 2},
        "rollout": {"n": 4, "max_new_tokens": 4},
        "algorithm": {"adv_estimator": "grpo"},
        # the shared-prompt forward is off under TP: off on both sides, the same arithmetic
        "actor": {"lr": 1e-3, "micro_batch_size": 4, "entropy_coef": 0.01, "kl_loss_coef": 0.1,
                  "share_prompt_forward": False, "tensor_parallel_size": tp},
        "trainer": {"total_steps": 3, "device": "cpu", "run_dir": str(tmp_path / name), "cpu_threads": 1,
                    "cpu_matmul": "aten", "val_before_train": True},  # (TP models multiply with ATen)
        "checkpoint": {"save_interval": 0},
        "reward": {"functions": [{"name": f"{HERE / 'row_reward.py'}:response_chars_reward"}]},
        "logging": {"backends": ["jsonl"]},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _same_run(split: list[dict], whole: list[dict]) -> None:
    assert [r["step"] for r in split] == [r["step"] for r in whole] == [0, 1, 2, 3]
    assert split[0]["val/score"] == whole[0]["val/score"]  # greedy answers of the initial weights
    one, ref = split[1], whole[1]
    for key in STEP1:
        assert one[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
    assert one["reward/mean"] == ref["reward/mean"] and one["reward/std"] == ref["reward/std"]  # the same samples
    assert one["actor/kl_loss"] == ref["actor/kl_loss"] == 0.0  # reference = policy before the first step
    for row in split[2:]:  # the KL loss ran on the tensor-parallel reference after the policy moved
        assert row["actor/kl_loss"] > 0 and row["actor/grad_norm"] > 0


def test_tp2_on_two_ranks_trains_as_one_process(tmp_path):
    verl_train(_config(tmp_path, "tp2", 2), tmp_path, nproc=2)
    verl_train(_config(tmp_path, "one", 1), tmp_path, nproc=1)
    _same_run(metrics(tmp_path / "tp2"), metrics(tmp_path / "one"))


def test_tp2_by_dp2_on_four_ranks_trains_as_dp2(tmp_path):
    # FSDP2 over the mesh's data-parallel dimension, each replica reading its own prompts
    verl_train(_config(tmp_path, "tp2dp2", 2), tmp_path, nproc=4)
    verl_train(_config(tmp_path, "dp2", 1), tmp_path, nproc=2)
    _same_run(metrics(tmp_path / "tp2dp2"), metrics(tmp_path / "dp2"))


def _resumed(tmp_path: Path, name: str, tp: int, checkpoint: Path) -> dict:
    """Step 3 of a run resumed at tensor-parallel size `tp` from `checkpoint` (step 2's)."""
    path = _config(tmp_path, name, tp)
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"].update({"resume": str(checkpoint), "val_before_train": False})
    path.write_text(yaml.safe_dump(cfg))
    verl_train(path, tmp_path, nproc=tp)
    (row,) = [r for r in metrics(tmp_path / name) if r["step"] == 3]
    return row


@pytest.mark.slow
@pytest.mark.parametrize("saved_tp", [2, 1])
def test_a_checkpoint_resumes_at_another_tensor_parallel_size_with_the_same_weights(tmp_path, saved_tp):
    """Saved at one size, resumed at both: the first resumed step runs on the loaded weights before any optimizer
    step, so its losses and gradient norm agree to the split matmuls' rounding (1e-5) only where the two sizes
    loaded the same weights (a weight resharded wrongly, e.g. a transposed or misplaced row shard, moves them by
    far more), and its rewards are the same samples."""
    path = _config(tmp_path, "saved", saved_tp)
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"]["total_steps"], cfg["checkpoint"]["save_interval"] = 2, 2
    path.write_text(yaml.safe_dump(cfg))
    verl_train(path, tmp_path, nproc=saved_tp)
    checkpoint = tmp_path / "saved" / "checkpoints" / "step_2"
    assert checkpoint.is_dir()
    split, whole = _resumed(tmp_path, "tp2", 2, checkpoint), _resumed(tmp_path, "tp1", 1, checkpoint)
    for key in (*STEP1, "actor/kl_loss"):
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key
    assert split["reward/mean"] == whole["reward/mean"] and split["reward/std"] == whole["reward/std"]
    assert split["actor/kl_loss"] > 0  # the reference (the initial weights, not the checkpoint's) was loaded too
