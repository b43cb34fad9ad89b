"""actor.old_logprobs: the sampler's log-probs as the old policy where they are the trainer's up to rounding
(no pass spent on them), a recomputing forward elsewhere; the update is the same function of the old
log-probs either way, the drift guard still catches a stale engine, and the rollout correction is off
exactly where it has nothing to do."""

from __future__ import annotations

import copy

import pytest
import torch
from rl_support import rl_config
from test_rl_update_efficiency import _assert_same, _batch, _reference_grads, _trainer, _update_grads

from verl.compat.command import translate
from verl.config import load_config
from verl.errors import ConfigError, RolloutError
from verl.rollout import HFKVCacheEngine
from verl.trainer.build.precision import resolve_precision
from verl.trainer.checks.config_checks import check_old_logprobs
from verl.trainer.rl.correction import plan_correction, plan_old_logprobs
from verl.trainer.rl_trainer import RLTrainer


def _plans(*overrides, device="cpu"):
    config = load_config(overrides=list(overrides))
    compute = resolve_precision(config, device, bf16_supported=True).compute
    return plan_old_logprobs(config, compute), plan_correction(config, compute)


@pytest.mark.parametrize(("overrides", "device", "why"), [
    (["rollout.engine=vllm"], "cpu", "rollout.engine=vllm"),
    ([], "cuda", "bfloat16"),
    (["devices.rollout=[1]", "rollout.max_staleness=2"], "cpu", "max_staleness=2"),
    (["rollout.top_k=5"], "cpu", "top_k/top_p"),
    (["rollout.top_p=0.9"], "cpu", "top_k/top_p"),
    (["actor.rollout_correction.mode=seq_tis"], "cpu", "corrects the sampler"),
])
def test_auto_recomputes_where_the_sampler_is_not_the_old_policy(overrides, device, why):
    old, _ = _plans(*overrides, device=device)
    assert not old.from_sampler and why in old.reason and "actor.old_logprobs=auto" in old.reason


def test_auto_takes_the_sampler_on_our_float32_engine_and_the_correction_is_then_off():
    old, correction = _plans()
    assert old.from_sampler and "no pass is spent" in old.describe()
    assert correction.mode == "off" and "nothing to correct" in correction.reason
    old, correction = _plans("actor.old_logprobs=recompute")  # the recomputed pass: off, bit-identical
    assert not old.from_sampler and correction.mode == "off" and "bit-identical" in correction.reason
    old, correction = _plans("rollout.engine=vllm")  # recomputed, and the sampler differs: corrected
    assert not old.from_sampler and correction.mode == "token_tis"
    old, correction = _plans("rollout.engine=vllm", "actor.old_logprobs=sampler")  # verl's bypass mode
    assert old.from_sampler and "rollout.engine=vllm" in old.reason and correction.mode == "off"


def test_the_sampler_with_an_explicit_correction_or_a_filtered_distribution_is_refused():
    with pytest.raises(ConfigError, match="has nothing to correct.*Fix: actor.old_logprobs=recompute"):
        load_config(overrides=["actor.old_logprobs=sampler", "actor.rollout_correction.mode=token_tis"])
    [err] = check_old_logprobs(load_config(overrides=["actor.old_logprobs=sampler", "rollout.top_p=0.9"]))
    assert isinstance(err, ConfigError) and "renormalised" in str(err) and "Fix:" in str(err)
    assert check_old_logprobs(load_config(overrides=["rollout.top_p=0.9"])) == []  # auto: recomputes


@pytest.mark.parametrize(("value", "ours"), [("true", "sampler"), ("false", "recompute")])
def test_verls_bypass_mode_translates(value, ours):
    out = translate([f"algorithm.rollout_correction.bypass_mode={value}"])
    assert out.ours == [f"actor.old_logprobs={ours}"]


def _counted(trainer: RLTrainer) -> list[int]:
    """The number of rows of each no-grad policy pass the trainer runs."""
    rows, real = [], trainer.sequence_logprobs

    def counted(model, batch):
        rows.append(len(batch))
        return real(model, batch)

    trainer.sequence_logprobs = counted
    return rows


@pytest.mark.parametrize("setting", ["auto", "sampler", "recompute"])
def test_only_recompute_spends_a_pass_over_every_response(tmp_path, setting):
    """With the sampler's old log-probs no no-grad pass runs at all: the update's forwards before its first
    optimizer step run on the sampling weights and measure the drift there."""
    trainer = RLTrainer(rl_config(tmp_path, "actor.ppo_epochs=2", f"actor.old_logprobs={setting}"))
    assert trainer.needs_old_logprobs and trainer.update_checks_drift == (setting != "recompute")
    rows, seen = _counted(trainer), {}
    real = trainer.compute_log_probs
    trainer.compute_log_probs = lambda batch: seen.setdefault("batch", real(batch))
    metrics = trainer.step()
    batch = seen["batch"]
    if setting == "recompute":
        assert rows == [len(batch)]  # the old log-probs' pass, which the drift check reads for free
        assert not torch.equal(batch.old_logprobs, batch.rollout_logprobs)  # the trainer's, to rounding
    else:
        assert rows == [] and torch.equal(batch.old_logprobs, batch.rollout_logprobs)
    assert 0 <= metrics["rollout/logprob_diff_mean"] < 1e-5


def test_the_update_is_the_same_function_of_the_old_logprobs_from_either_source(tmp_path):
    """Given the same old log-probs, the sampler's update equals the recomputing one bit for bit, and equals a
    float64 reference (one forward, one PPO loss with those old log-probs, one backward)."""
    recompute = _trainer(tmp_path / "r", "actor.ppo_epochs=2", "actor.old_logprobs=recompute",
                         "actor.skip_zero_advantage=false")
    batch = _batch(recompute, equal_groups=())
    want, want_metrics, _ = _update_grads(recompute, batch)

    sampler = _trainer(tmp_path / "s", "actor.ppo_epochs=2", "actor.old_logprobs=sampler",
                       "actor.skip_zero_advantage=false", "rollout.max_logprob_drift=null",
                       "rollout.drift_noise_ratio=null")  # the shifted sampler below is a drift by design
    sampler.model.load_state_dict(recompute.model.state_dict())
    given = copy.copy(batch)
    given.rollout_logprobs, given.old_logprobs = batch.old_logprobs.clone(), None  # a sampler that agrees exactly
    given = sampler.compute_log_probs(given)
    assert torch.equal(given.old_logprobs, batch.old_logprobs)
    got, got_metrics, _ = _update_grads(sampler, given)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert got_metrics["actor/pg_loss"] == want_metrics["actor/pg_loss"]

    shifted = copy.copy(batch)  # a sampler 5% likelier on every token: the update reads its log-probs
    shifted.rollout_logprobs, shifted.old_logprobs = batch.old_logprobs + 0.05, None
    shifted = sampler.compute_log_probs(shifted)
    got, _, _ = _update_grads(sampler, shifted)
    _assert_same(got, _reference_grads(sampler, shifted), 1e-6)
    assert not all(torch.allclose(got[k], want[k]) for k in want)


def test_the_guard_still_catches_a_stale_engine(tmp_path):
    config = rl_config(tmp_path, "trainer.total_steps=8", "actor.lr=0.05", "actor.grad_clip=null",
                       "actor.ppo_epochs=2")
    trainer = RLTrainer(config)
    assert trainer.old_logprobs_plan.from_sampler
    trainer.engine = HFKVCacheEngine(copy.deepcopy(trainer.model))  # samples from the initial weights forever
    with pytest.raises(RolloutError, match="'hf' rollout engine"):
        trainer.fit()
    assert 1 <= trainer.step_count < 8


def test_an_engine_without_logprobs_is_recomputed_on_auto_and_refused_on_sampler(tmp_path):
    for setting in ("auto", "sampler"):
        trainer = RLTrainer(rl_config(tmp_path / setting, "actor.ppo_epochs=2", f"actor.old_logprobs={setting}"))
        batch = trainer.compute_reward(trainer.generate(trainer.get_batch()))
        batch.rollout_logprobs = None  # a custom engine that reports none
        if setting == "sampler":
            with pytest.raises(RolloutError, match="gave no log-probs.*Fix: actor.old_logprobs=recompute"):
                trainer.compute_log_probs(batch)
        else:
            assert trainer.compute_log_probs(batch).old_logprobs is not None
