"""actor.rollout_correction: on where the sampler can differ from the trainer, an exact no-op where it cannot,
and the deprecated actor.tis_cap mapped onto it."""

from __future__ import annotations

import copy

import pytest
import torch
from rl_support import rl_config, snapshot

from verl.config import load_config
from verl.errors import ConfigError
from verl.trainer.build.precision import resolve_precision
from verl.trainer.rl.correction import plan_correction
from verl.trainer.rl_trainer import RLTrainer


def _plan(*overrides, device="cpu"):
    config = load_config(overrides=list(overrides))
    return plan_correction(config, resolve_precision(config, device, bf16_supported=True).compute)


def test_auto_is_on_where_the_sampler_can_differ_and_off_where_it_cannot():
    off = _plan("rollout.engine=hf", "actor.old_logprobs=recompute")
    assert off.mode == "off" and "bit-identical" in off.reason
    sampler = _plan("rollout.engine=hf")  # auto: the sampler's log-probs are the old policy's
    assert sampler.mode == "off" and "nothing to correct" in sampler.reason
    vllm = _plan("rollout.engine=vllm")
    assert vllm.mode == "token_tis" and "rollout.engine=vllm" in vllm.reason
    bf16 = _plan(device="cuda")  # float32 masters, bfloat16 compute (fsdp.mixed_precision=auto)
    assert bf16.mode == "token_tis" and "bfloat16" in bf16.reason
    assert _plan("fsdp.mixed_precision=false", device="cuda").mode == "off"  # float32 compute on the GPU too
    assert _plan("rollout.engine=vllm", "actor.rollout_correction.mode=off").mode == "off"
    explicit = _plan("actor.rollout_correction.mode=seq_mask")
    assert explicit.mode == "seq_mask" and "set by actor.rollout_correction.mode=seq_mask" in explicit.describe()


def test_auto_reads_max_staleness_of_an_async_rollout():
    stale = load_config(overrides=["devices.rollout=[1]", "rollout.max_staleness=2"])
    plan = plan_correction(stale, torch.float32)
    assert plan.mode == "token_tis" and "max_staleness=2" in plan.reason
    assert plan_correction(load_config(overrides=["devices.rollout=[1]", "rollout.max_staleness=0"]),
                           torch.float32).mode == "off"  # k = 0: synchronous, the exact no-op
    assert plan_correction(load_config(overrides=["rollout.max_staleness=2"]), torch.float32).mode == "off"  # no async


def test_tis_cap_is_a_deprecated_alias_of_token_tis():
    with pytest.warns(FutureWarning, match="actor.rollout_correction.mode=token_tis"):
        config = load_config(overrides=["actor.tis_cap=3.0"])
    assert config.actor.rollout_correction.mode == "token_tis" and config.actor.rollout_correction.cap == 3.0
    with pytest.raises(ConfigError, match="keep only actor.rollout_correction"):
        load_config(overrides=["actor.tis_cap=3.0", "actor.rollout_correction.mode=seq_mask"])
    with pytest.raises(ConfigError, match="lo < 1 < hi"):
        load_config(overrides=["actor.rollout_correction.hi=0.9"])


def _one_step(tmp_path, *overrides):
    torch.manual_seed(0)
    trainer = RLTrainer(rl_config(tmp_path, "trainer.total_steps=1", "actor.skip_zero_advantage=false",
                                  *overrides))
    metrics = trainer.step()
    return trainer, snapshot(trainer.model), metrics


def test_auto_is_a_bit_identical_update_with_our_float32_sampler(tmp_path):
    """The hf engine on the trainer's float32 weights: auto resolves to off and the update is bit-for-bit the
    uncorrected one. token_tis on the same batch is not (the sampler's cached decode and the trainer's
    forward agree only to rounding), so the comparison can fail."""
    auto, auto_weights, auto_metrics = _one_step(tmp_path / "auto")
    assert auto.correction.mode == "off" and not any(k.startswith("rollout_corr/") for k in auto_metrics)
    _, off_weights, _ = _one_step(tmp_path / "off", "actor.rollout_correction.mode=off")
    _, tis_weights, tis_metrics = _one_step(tmp_path / "tis", "actor.rollout_correction.mode=token_tis")
    assert all(torch.equal(auto_weights[k], off_weights[k]) for k in off_weights)
    assert not all(torch.equal(tis_weights[k], off_weights[k]) for k in off_weights)
    assert 0 < tis_metrics["rollout_corr/kl_k3"] < 1e-6
    assert tis_metrics["rollout_corr/ratio_min"] <= tis_metrics["rollout_corr/ratio_mean"] <= (
        tis_metrics["rollout_corr/ratio_max"])


@pytest.mark.parametrize("mode", ["token_mask", "seq_mask"])
def test_rejected_responses_add_nothing_to_the_gradient(tmp_path, mode):
    """A response the sampler found e^10 times likelier than the trainer is rejected: the update equals the
    plain one with that response's advantages zeroed (it stays in the normaliser), and masked_frac says so."""
    from test_rl_update_efficiency import _assert_same, _batch, _reference_grads, _trainer, _update_grads

    from verl.trainer.forward.logprobs import response_logprobs

    trainer = _trainer(tmp_path, f"actor.rollout_correction.mode={mode}", "rollout.max_logprob_drift=null")
    batch = _batch(trainer, equal_groups=())
    with torch.no_grad():
        logprobs, _ = response_logprobs(trainer.model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                        batch.response_ids.shape[1])
    batch.rollout_logprobs = logprobs.clone()
    batch.rollout_logprobs[0] += 10.0
    got, metrics, _ = _update_grads(trainer, batch)
    kept = copy.copy(batch)
    kept.advantages = batch.advantages.double().clone()
    kept.advantages[0] = 0.0
    _assert_same(got, _reference_grads(trainer, kept), 1e-6)
    mask = batch.response_mask.float()
    assert metrics["rollout_corr/masked_frac"] == pytest.approx(float(mask[0].sum() / mask.sum()))


def test_ratio_extremes_are_the_extremes_over_micro_batches_and_steps():
    from verl.trainer.rl import update

    sums = update._MetricSums(update.ACTOR_METRICS)
    t = torch.tensor
    sums.add_step([({"rollout_corr/ratio_max": t(1.5), "rollout_corr/ratio_min": t(0.9)}, 0.5, 0.5),
                   ({"rollout_corr/ratio_max": t(3.0), "rollout_corr/ratio_min": t(0.7)}, 0.5, 0.5)])
    sums.add_step([({"rollout_corr/ratio_max": t(2.0), "rollout_corr/ratio_min": t(0.8)}, 1.0, 1.0)])
    assert sums.result({}) == {"rollout_corr/ratio_max": 3.0, "rollout_corr/ratio_min": pytest.approx(0.7)}
