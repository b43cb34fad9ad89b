"""Exact resume: stopping and resuming from a checkpoint gives the same run, bit for bit, as never stopping."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from rl_support import deterministic_rows, read_metrics, rl_config, state_tensors

from verl.checkpoint import TrainingInterrupted, list_checkpoints
from verl.trainer.rl_trainer import RLTrainer


class PreemptedTrainer(RLTrainer):
    """Receives SIGTERM (as from a cluster scheduler) in the middle of step `stop_at`."""

    stop_at = 2

    def step(self) -> dict[str, float]:
        if self.step_count + 1 == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().step()


# Exercise every piece of state a resume must restore: cosine LR schedule with warm-up (scheduler state),
# two shuffled epochs of two mini-batches (shuffle generator, old log-probs), sampling at temperature 1
# (sampling generator), the environment's prompt order, and for PPO the critic, its optimizer and the
# adaptive KL controller.
COMMON = ("trainer.total_steps=4", "checkpoint.save_interval=2", "actor.lr_schedule=cosine", "actor.warmup_steps=1",
          "actor.ppo_epochs=2", "actor.mini_batch_size=2", "actor.micro_batch_size=3", "trainer.val_every=2")
CASES = {
    "grpo": ("algorithm.adv_estimator=grpo", "actor.kl_loss_coef=0.01"),
    "ppo": ("algorithm.adv_estimator=gae", "algorithm.kl_in_reward=true", "algorithm.kl_ctrl=adaptive",
            "algorithm.kl_coef=0.05", "critic.lr_schedule=cosine", "critic.ppo_epochs=2", "critic.mini_batch_size=2"),
    # the adaptive entropy coefficient (its state is checkpointed) and the high-entropy token mask
    "grpo_entropy": ("algorithm.adv_estimator=grpo", "actor.target_entropy=20", "actor.entropy_coef_step=0.001",
                     "actor.entropy_coef_max=1", "actor.entropy_top_fraction=0.5"),
}


@pytest.mark.parametrize("algo", sorted(CASES))
def test_resume_is_bit_exact(tmp_path, algo):
    overrides = (*COMMON, *CASES[algo])
    straight = RLTrainer(rl_config(tmp_path / "straight", *overrides))
    straight.fit()

    interrupted_dir = tmp_path / "interrupted"
    first = PreemptedTrainer(rl_config(interrupted_dir, *overrides))
    with pytest.raises(TrainingInterrupted, match=r"interrupted at step 2/4 \(SIGTERM\)") as stopped:
        first.fit()
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert first.step_count == 2  # stopped after the step that received the signal, and saved it
    assert [c.step for c in list_checkpoints(interrupted_dir)] == [2]
    assert [r["step"] for r in read_metrics(interrupted_dir)] == [1, 2]

    second = RLTrainer(rl_config(interrupted_dir, *overrides, "trainer.resume=auto"))
    assert second.step_count == 0
    second.fit()
    assert second.step_count == 4

    expected, got = read_metrics(tmp_path / "straight"), read_metrics(interrupted_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert deterministic_rows(got) == deterministic_rows(expected)
    assert "val/score" in got[1] and "val/score" in got[3]
    if algo == "ppo":
        assert "critic/vf_loss" in got[3] and got[3]["kl/coef"] != 0.05  # the adaptive coefficient moved
    if algo == "grpo_entropy":  # the coefficient grew every step (entropy below the target), from 0
        coefs = [r["actor/entropy_coef"] for r in got]
        assert coefs[0] == 0.0 and coefs[0] < coefs[1] < coefs[2] < coefs[3] < 1

    a, b = dict(state_tensors(straight)), dict(state_tensors(second))
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    mismatched = [k for k in a if not torch.equal(a[k], b[k])]
    assert not mismatched, f"tensors differ after resume: {mismatched[:5]}"
    assert second.scheduler.state_dict() == straight.scheduler.state_dict()
    assert second.env.state_dict() == straight.env.state_dict()
    assert torch.equal(second.generator.get_state(), straight.generator.get_state())
    assert torch.equal(second.shuffle_generator.get_state(), straight.shuffle_generator.get_state())


def test_resume_never_starts_over_and_resume_path(tmp_path):
    overrides = ("trainer.total_steps=2", "checkpoint.save_interval=1")
    RLTrainer(rl_config(tmp_path / "a", *overrides)).fit()
    ckpt = Path(list_checkpoints(tmp_path / "a")[0].path)
    assert ckpt.name == "step_1"
    # an explicit checkpoint path continues from that step, in a new run directory
    trainer = RLTrainer(rl_config(tmp_path / "b", *overrides, f"trainer.resume={ckpt}"))
    trainer.fit()
    assert [r["step"] for r in trainer.history] == [1, 2] and trainer.step_count == 2
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [2]
    fresh = RLTrainer(rl_config(tmp_path / "a", *overrides, "trainer.resume=never", "trainer.total_steps=1"))
    fresh.fit()
    assert fresh.step_count == 1
