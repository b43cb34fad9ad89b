"""The calibrated on-policy guard: an engine one update behind at lr 1e-6 (far under the fixed 0.1 limit) is
caught against the run's own numeric noise, and an engine that falls further behind with every update is
caught by its growing drift."""

from __future__ import annotations

import copy

import pytest
from rl_support import read_metrics, rl_config

from verl.config import load_config
from verl.errors import RolloutError
from verl.rollout import HFKVCacheEngine
from verl.trainer.rl.correction import DriftGuard
from verl.trainer.rl_trainer import RLTrainer


def _lagging_trainer(tmp_path, skip: set[int] | None, *overrides) -> RLTrainer:
    """A trainer whose engine samples from its own copy of the policy, synced before every step's rollout
    except at the steps in `skip` (None: never synced)."""
    trainer = RLTrainer(rl_config(tmp_path, "actor.lr=1e-6", *overrides))
    copy_ = copy.deepcopy(trainer.model)
    engine = HFKVCacheEngine(copy_)
    generate = engine.generate

    def synced_generate(*args, **kwargs):
        if skip is not None and trainer.step_count + 1 not in skip:
            copy_.load_state_dict(trainer.model.state_dict())
        return generate(*args, **kwargs)

    engine.generate = synced_generate
    trainer.engine = engine
    return trainer


def test_one_skipped_weight_sync_at_lr_1e6_is_caught(tmp_path):
    trainer = _lagging_trainer(tmp_path, {3}, "trainer.total_steps=4")
    with pytest.raises(RolloutError, match="numeric noise") as err:
        trainer.fit()
    assert trainer.step_count == 2 and "step 3" in str(err.value) and "Fix:" in str(err.value)
    rows = read_metrics(tmp_path)
    assert all(row["rollout/logprob_diff_mean"] < 1e-6 for row in rows)  # steps 1-2: synced, rounding only


def test_the_fixed_limit_alone_misses_an_engine_one_update_behind(tmp_path):
    trainer = _lagging_trainer(tmp_path, {3}, "trainer.total_steps=3", "rollout.drift_noise_ratio=null",
                               "rollout.drift_growth_steps=0")
    trainer.fit()
    lagged = read_metrics(tmp_path)[2]["rollout/logprob_diff_mean"]
    assert 1e-6 < lagged < 1e-3  # one update's worth: 20x over the noise, 100x under max_logprob_drift=0.1


def test_an_engine_falling_further_behind_is_caught_by_its_growing_drift(tmp_path):
    trainer = _lagging_trainer(tmp_path, None, "trainer.total_steps=8", "rollout.drift_noise_ratio=null",
                               "rollout.drift_growth_steps=4")
    with pytest.raises(RolloutError, match="falls further behind with every update"):
        trainer.fit()
    assert trainer.step_count < 7


def test_a_synced_engine_passes_and_the_noise_survives_a_resume(tmp_path):
    trainer = _lagging_trainer(tmp_path, set(), "trainer.total_steps=4")
    trainer.fit()
    noise = trainer.drift_guard.noise
    assert noise is not None and 0 <= noise < 1e-6
    fresh = DriftGuard()
    fresh.load_state_dict(trainer.trainer_state()["drift_guard"])
    assert fresh.noise == noise


def _judge(guard: DriftGuard, drifts, **overrides) -> list[str | None]:
    rollout = load_config(overrides=[f"rollout.{k}={v}" for k, v in overrides.items()]).rollout
    return [guard.judge(d, rollout=rollout, step=i + 1) for i, d in enumerate(drifts)]


def test_guard_calibrates_on_step_one_and_tolerates_noise():
    guard = DriftGuard()
    noisy = [1e-3, 1.5e-3, 0.8e-3, 1.9e-3, 1.2e-3, 1.7e-3, 0.9e-3, 1.8e-3]  # a bf16 engine: noise only
    assert _judge(guard, noisy) == [None] * len(noisy) and guard.noise == 1e-3
    assert "21x the run's own numeric noise" in _judge(DriftGuard(), [1e-3, 2.1e-2])[1]
    growing = [1e-3, 1.1e-3, 1.3e-3, 1.2e-3, 2e-3, 3e-3, 4.5e-3]
    verdicts = _judge(DriftGuard(), growing, drift_growth_steps=4)
    assert verdicts[:-1] == [None] * (len(growing) - 1) and "grew on 3 of the last 3 updates" in verdicts[-1]
    assert _judge(DriftGuard(), growing, drift_growth_steps=0) == [None] * len(growing)
    resumed = DriftGuard()  # resumed from a checkpoint without the noise: not calibrated on a trained policy
    assert [resumed.judge(1.0, rollout=load_config(overrides=[]).rollout, step=5)] == [None]
    assert resumed.noise is None
