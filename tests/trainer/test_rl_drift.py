"""The on-policy guard: the sampler's log-probs are compared with the trainer's every step; an engine that
keeps its own (stale) weights is stopped with an error naming it, our sampler passes."""

from __future__ import annotations

import copy

import pytest
import torch
from rl_support import read_metrics, rl_config

from verl.errors import RolloutError
from verl.rollout import HFKVCacheEngine
from verl.trainer.rl_trainer import RLTrainer


@pytest.mark.parametrize("extra", [["actor.kl_loss_coef=0.01"], []], ids=["old-logprobs", "sampled-subset"])
def test_our_sampler_stays_on_policy(tmp_path, extra):
    trainer = RLTrainer(rl_config(tmp_path, "trainer.total_steps=3", *extra))
    assert trainer.needs_old_logprobs == bool(extra)
    trainer.fit()
    rows = read_metrics(tmp_path)
    for row in rows:
        assert 0.0 <= row["rollout/logprob_diff_mean"] <= row["rollout/logprob_diff_max"] < 1e-4


def test_a_stale_engine_is_caught(tmp_path):
    config = rl_config(tmp_path, "trainer.total_steps=8", "actor.lr=0.05", "actor.grad_clip=null")
    trainer = RLTrainer(config)
    trainer.engine = HFKVCacheEngine(copy.deepcopy(trainer.model))  # samples from the initial weights forever
    with pytest.raises(RolloutError) as err:
        trainer.fit()
    msg = str(err.value)
    assert "'hf' rollout engine" in msg and "rollout.max_logprob_drift=0.1" in msg and "Fix:" in msg
    assert 1 <= trainer.step_count < 8  # caught within a few steps, not at the end
    assert read_metrics(tmp_path)[0]["rollout/logprob_diff_mean"] < 1e-4  # step 1: the weights still agree


def test_drift_is_logged_not_enforced_with_top_k(tmp_path):
    config = rl_config(tmp_path, "trainer.total_steps=2", "rollout.top_k=5", "rollout.max_logprob_drift=1e-9")
    RLTrainer(config).fit()  # top-k renormalises the sampler's distribution: no false alarm
    assert all(row["rollout/logprob_diff_mean"] > 0 for row in read_metrics(tmp_path))


def test_a_single_on_policy_update_checks_drift_on_its_own_forward(tmp_path):
    """No old log-probs and dropout off: the update's forward is the on-policy pass, so the check costs no
    forward of its own and covers every row the update trains on."""
    trainer = RLTrainer(rl_config(tmp_path, "actor.skip_zero_advantage=false"))
    assert not trainer.needs_old_logprobs and trainer.update_checks_drift

    def no_extra_pass(*a, **k):
        raise AssertionError("the drift check ran a forward of its own")

    trainer.sequence_logprobs = no_extra_pass
    for _ in range(2):
        metrics = trainer.step()
        trainer.step_count += 1
        assert 0.0 <= metrics["rollout/logprob_diff_mean"] <= metrics["rollout/logprob_diff_max"] < 1e-4


@pytest.mark.parametrize("extra", [[], ["actor.ppo_epochs=2", "actor.mini_batch_size=2"]],
                         ids=["single-update", "sampler-old-logprobs"])
def test_a_stale_engine_is_caught_before_the_optimizer_step(tmp_path, extra):
    """One on-policy update, or several on the sampler's old log-probs: the forwards before the first optimizer
    step check the drift, and a failed check moves no weight."""
    trainer = RLTrainer(rl_config(tmp_path, "actor.lr=0.05", "actor.grad_clip=null", *extra))
    assert trainer.update_checks_drift
    trainer.engine = HFKVCacheEngine(copy.deepcopy(trainer.model))
    steps = {"n": 0}
    real_step = trainer.optimizer.step

    def counted_step(*a, **k):
        steps["n"] += 1
        return real_step(*a, **k)

    trainer.optimizer.step = counted_step
    with pytest.raises(RolloutError, match="'hf' rollout engine"):
        for _ in range(8):
            before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            done = steps["n"]
            trainer.step()
            trainer.step_count += 1
    assert steps["n"] == done  # the failing step did not step the optimizer ...
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())  # ... nor move a weight


class OwnUpdate(RLTrainer):
    def update_policy(self, batch):
        return super().update_policy(batch)


class OwnOptimize(RLTrainer):
    def optimize(self, *args, before_step=None, **kwargs):  # drops the hook the update's drift check rides on
        return super().optimize(*args, **kwargs)


@pytest.mark.parametrize("case", ["own-update", "own-optimize", "dropout-kept", "old-logprobs"])
def test_the_separate_check_runs_where_the_update_cannot_check(tmp_path, case):
    """A subclass's own update_policy or optimize might not check; with dropout kept the train-mode forward is
    not the sampler's; with old log-probs the check is on them. Each step still logs the drift."""
    extra = {"dropout-kept": ["actor.disable_dropout=false"],
             "old-logprobs": ["actor.ppo_epochs=2", "actor.old_logprobs=recompute"]}.get(case, [])
    cls = {"own-update": OwnUpdate, "own-optimize": OwnOptimize}.get(case, RLTrainer)
    trainer = cls(rl_config(tmp_path, *extra))
    assert not trainer.update_checks_drift
    calls = {"n": 0}
    real = trainer.sequence_logprobs

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    trainer.sequence_logprobs = counted
    metrics = trainer.step()
    assert calls["n"] == 1 and metrics["rollout/logprob_diff_max"] < 1e-4
