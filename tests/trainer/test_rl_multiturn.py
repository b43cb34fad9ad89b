"""RL on multi-turn episodes: observation tokens are attended to but never trained on; the reward sits on
the last model token; GRPO / RLOO / PPO run unchanged; metrics; resume mid-training is bit-exact."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from rl_support import deterministic_rows, read_metrics, state_tensors
from tiny_support import tiny_run_config

from verl.algorithms import aggregate_loss, kl_penalty, ppo_policy_loss
from verl.checkpoint import TrainingInterrupted
from verl.errors import ConfigError
from verl.trainer.forward.logprobs import response_logprobs
from verl.trainer.rl_trainer import RLTrainer

HERE = Path(__file__).resolve().parent


def mt_config(run_dir, *overrides):
    return tiny_run_config(
        run_dir, f"env.name={HERE / 'multiturn_env.py'}:ToolEnv", "data.train_batch_size=4", "rollout.n=4",
        "rollout.max_new_tokens=6", "rollout.stop=[e,a]", "actor.lr=1e-3", "critic.lr=1e-3",
        "actor.micro_batch_size=4", *overrides)


def test_episode_batch_masks_reward_placement_and_logprobs(tmp_path):
    trainer = RLTrainer(mt_config(tmp_path, "actor.ppo_epochs=2", "actor.kl_loss_coef=0.01",
                                  "actor.old_logprobs=recompute"))  # the trainer's own pass over each episode
    assert trainer.multiturn is not None
    batch = trainer.generate(trainer.get_batch())
    batch = trainer.compute_log_probs(trainer.compute_reward(batch))
    mask, attn = batch.response_mask.bool(), batch.response_attention_mask.bool()
    observed = attn & ~mask
    assert observed.any() and not (mask & ~attn).any()  # observation tokens: attended, not trained on
    assert torch.equal(batch.attention_mask[:, batch.prompt_ids.shape[1]:].bool(), attn)
    # The reward sits on the last model-written token of each episode, not on an observation token.
    for i in range(len(batch)):
        last_model = int(mask[i].nonzero().max())
        assert torch.count_nonzero(batch.token_rewards[i]) <= 1
        assert float(batch.token_rewards[i, last_model]) == float(batch.scores[i])
    assert torch.equal(batch.scores.cpu(), batch.env_scores.cpu())
    # Old log-probs (one forward over each episode) equal the sampler's on model tokens.
    assert torch.allclose(batch.old_logprobs[mask], batch.rollout_logprobs[mask], atol=1e-5)
    assert batch.metrics["rollout/logprob_diff_max"] < 1e-5
    # Loss, KL and entropy as the update computes them do not see observation positions at all.
    batch = trainer.compute_advantages(trainer.compute_ref_log_probs(batch))
    with torch.no_grad():
        lp, ent = response_logprobs(trainer.model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                    batch.response_ids.shape[1], with_entropy=True)
    assert torch.allclose(lp[mask], batch.old_logprobs[mask], atol=1e-6)
    assert (batch.advantages[observed] == 0).all()
    m = mask.float()

    def terms(lp, ent, ref):
        loss, _ = ppo_policy_loss(lp, batch.old_logprobs, batch.advantages, m, clip_low=0.2, clip_high=0.2,
                                  agg="token-mean")
        return loss, aggregate_loss(ent, m, "token-mean"), aggregate_loss(kl_penalty(lp, ref, "k3"), m, "token-mean")

    noise = torch.where(observed, 50.0, 0.0)
    for a, b in zip(terms(lp, ent, batch.ref_logprobs),
                    terms(lp + noise, ent - noise, batch.ref_logprobs - noise), strict=True):
        assert torch.equal(a, b)
    assert set(batch.metrics) >= {"episode/turns_mean", "episode/tool_calls_mean", "episode/tool_errors_mean",
                                  "episode/truncated_ratio"}

def test_episodes_train_on_the_samplers_old_logprobs_with_the_drift_checked(tmp_path):
    """actor.old_logprobs=auto on episodes: the sampler's log-probs on model tokens are the old policy (0 on
    observation tokens, which no loss reads), and the update's first forwards measure the drift."""
    trainer = RLTrainer(mt_config(tmp_path, "actor.ppo_epochs=2"))
    seen = {}
    real = trainer.compute_log_probs
    trainer.compute_log_probs = lambda batch: seen.setdefault("batch", real(batch))
    metrics = trainer.step()
    batch = seen["batch"]
    assert torch.equal(batch.old_logprobs, batch.rollout_logprobs)
    assert (batch.response_attention_mask.bool() & ~batch.response_mask.bool()).any()  # observations present
    assert 0 <= metrics["rollout/logprob_diff_mean"] <= metrics["rollout/logprob_diff_max"] < 1e-5


@pytest.mark.parametrize("algo", [
    ("algorithm.adv_estimator=grpo", "actor.kl_loss_coef=0.01"),
    ("algorithm.adv_estimator=rloo",),
    ("algorithm.adv_estimator=gae", "algorithm.kl_in_reward=true"),
])


def test_estimators_train_on_episodes(tmp_path, algo):
    trainer = RLTrainer(mt_config(tmp_path, "trainer.total_steps=2", "trainer.val_every=2", *algo))
    trainer.fit()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["actor/grad_norm"] > 0 and torch.isfinite(torch.tensor(r["actor/pg_loss"]))
        assert r["episode/tool_calls_mean"] > 0 and 1 <= r["episode/turns_mean"] <= 3
        assert 0 <= r["episode/truncated_ratio"] <= 1 and r["rollout/logprob_diff_max"] < 1e-5
    assert "val/score" in rows[1] and "val/episode/turns_mean" in rows[1]


def test_multiturn_env_needs_the_hf_engine_and_valid_limits(tmp_path):
    with pytest.raises(ConfigError, match="max_episode_tokens .* must be an int >= 1, got 0"):
        RLTrainer(mt_config(tmp_path, "env.kwargs.max_episode_tokens=0"))


class PreemptedTrainer(RLTrainer):
    stop_at = 2

    def step(self):
        if self.step_count + 1 == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().step()


def test_resume_mid_training_is_bit_exact(tmp_path):
    overrides = ("trainer.total_steps=3", "checkpoint.save_interval=2", "actor.ppo_epochs=2",
                 "actor.mini_batch_size=2", "actor.micro_batch_size=3", "trainer.val_every=2",
                 "actor.kl_loss_coef=0.01")
    straight = RLTrainer(mt_config(tmp_path / "straight", *overrides))
    straight.fit()
    first = PreemptedTrainer(mt_config(tmp_path / "stopped", *overrides))
    with pytest.raises(TrainingInterrupted):
        first.fit()
    second = RLTrainer(mt_config(tmp_path / "stopped", *overrides, "trainer.resume=auto"))
    second.fit()
    expected, got = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "stopped")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert deterministic_rows(got) == deterministic_rows(expected)
    assert "episode/turns_mean" in got[2]
    a, b = dict(state_tensors(straight)), dict(state_tensors(second))
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert second.env.state_dict() == straight.env.state_dict()


def test_token_budget_trim_keeps_observation_tokens_inside_an_episode():
    """The trim of a micro-batch goes by the attended response (model + observation tokens), not by the
    loss mask, which has holes where the environment answered."""
    import torch

    from verl.batch import RolloutBatch
    from verl.trainer.rl import update

    attended = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]])
    model_tokens = torch.tensor([[1, 1, 0, 0, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0]])  # 3 observation tokens
    batch = RolloutBatch(rows=[{}, {}], group_ids=torch.arange(2), prompt_ids=torch.ones(2, 3, dtype=torch.long),
                         prompt_mask=torch.ones(2, 3, dtype=torch.long), response_ids=torch.arange(16).view(2, 8),
                         response_mask=model_tokens, response_attention_mask=attended,
                         rollout_logprobs=torch.zeros(2, 8))
    mb = update.micro_batch(batch, torch.arange(2), trim=True)
    assert mb.response_ids.shape[1] == 6  # the last model token (column 5) is kept, not cut at 3
    assert mb.response_attention_mask.shape == mb.response_mask.shape == mb.rollout_logprobs.shape == (2, 6)
    assert mb.attention_mask.shape[1] == mb.input_ids.shape[1] == 9


def test_shared_prompt_forward_on_episodes_equals_the_plain_forward(tmp_path):
    """Observation tokens are attended to in the shared-prompt forward too (its attention is the episode's,
    not the loss mask), so both forwards give the same log-probs on model-written tokens."""
    import torch

    from verl.trainer.forward.logprobs import response_logprobs

    trainer = RLTrainer(mt_config(tmp_path))
    batch = trainer.generate(trainer.get_batch())
    assert bool((batch.response_attention != batch.response_mask).any())  # the episodes have observations
    assert trainer.shares_prompt(trainer.model)
    with torch.no_grad():
        shared, _ = trainer.policy_logprobs(trainer.model, batch, temperature=1.0)
        plain, _ = response_logprobs(trainer.model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                     batch.response_ids.shape[1])
    mask = batch.response_mask.bool()
    assert torch.allclose(shared[mask], plain[mask], atol=1e-5)


def test_the_overlong_buffer_is_refused_for_multi_turn_episodes(tmp_path):
    with pytest.raises(ConfigError, match="algorithm.overlong_buffer shapes single-turn rewards"):
        RLTrainer(mt_config(tmp_path, "algorithm.overlong_buffer=2"))


def test_validation_runs_several_episodes_per_held_out_prompt(tmp_path):
    trainer = RLTrainer(mt_config(tmp_path, "rollout.val_n=3", "rollout.val_temperature=1.0"))
    rows = trainer.env.val_rows() or trainer.env.get_batch(4)
    metrics = trainer.evaluate(rows, prefix="val")
    assert 0 <= metrics["val/score"] <= metrics.get("val/pass@3", metrics.get("val/best@3"))


def test_dynamic_sampling_keeps_the_episodes_observation_tokens(tmp_path):
    """algorithm.filter_groups concatenates the groups it keeps; the episodes' attention mask (observation
    tokens) and environment rewards must come through, or the update's forward drops every observation
    token and its log-probs drift from the sampler's (here by ~0.03 per token; in the tool-calculator demo by
    ~0.8, a RolloutError at step 1)."""
    trainer = RLTrainer(mt_config(tmp_path, "algorithm.filter_groups=true", "algorithm.max_resample_rounds=1"))
    metrics = trainer.step()
    assert metrics["rollout/logprob_diff_mean"] < 1e-5 and metrics["actor/grad_norm"] > 0
