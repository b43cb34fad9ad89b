"""A run with no learning signal warns once; a resume survives a metrics.jsonl whose last line a crash cut."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from rl_support import read_metrics, rl_config

from verl.trainer.rl.signal_watch import NO_SIGNAL_STEPS, SignalWatch
from verl.trainer.rl_trainer import RLTrainer

GOOD = {"reward/zero_std_group_frac": 0.25, "actor/grad_norm": 0.3}
FLAT = {"reward/zero_std_group_frac": 1.0, "actor/grad_norm": 0.0}


def constant_reward(prompt: Any, response: str, ground_truth: Any, **meta: Any) -> float:
    return 0.5


def _observe(sequence: list[dict[str, float]]) -> list[str]:
    watch = SignalWatch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, metrics in enumerate(sequence, start=1):
            watch.observe(metrics, step)
    return [str(w.message) for w in caught]


def test_warns_exactly_once_after_n_steps_without_signal():
    assert _observe([FLAT] * (NO_SIGNAL_STEPS - 1)) == []
    said = _observe([GOOD, *[FLAT] * (NO_SIGNAL_STEPS * 3)])
    assert len(said) == 1
    assert f"no learning signal for {NO_SIGNAL_STEPS} steps in a row (steps 2-{NO_SIGNAL_STEPS + 1})" in said[0]
    assert "rollout.n=1" in said[0] and "temperature 0" in said[0] and "constant" in said[0]


def test_a_step_with_signal_restarts_the_count():
    sequence = ([FLAT] * (NO_SIGNAL_STEPS - 1) + [GOOD]) * 3
    assert _observe(sequence) == []
    # zero gradient alone counts too; validation-only rows (neither key) neither count nor break the run
    grad_only = {"reward/zero_std_group_frac": 0.5, "actor/grad_norm": 0.0}
    said = _observe([grad_only, {"val/reward": 1.0}] * NO_SIGNAL_STEPS)
    assert len(said) == 1 and "actor/grad_norm=0" in said[0]


def test_constant_reward_run_warns(tmp_path):
    spec = {"name": f"{Path(__file__).resolve()}:constant_reward"}
    config = rl_config(tmp_path, f"trainer.total_steps={NO_SIGNAL_STEPS}", "checkpoint.save_interval=0",
                       "algorithm.adv_estimator=grpo", reward=spec)
    with pytest.warns(UserWarning, match="no learning signal") as record:
        RLTrainer(config).fit()
    assert len([w for w in record if "no learning signal" in str(w.message)]) == 1


def test_resume_after_a_partial_metrics_line(tmp_path):
    common = ("checkpoint.save_interval=1", "algorithm.adv_estimator=grpo")
    RLTrainer(rl_config(tmp_path, "trainer.total_steps=2", *common)).fit()
    metrics = tmp_path / "metrics.jsonl"
    with metrics.open("a", encoding="utf-8") as fh:
        fh.write('{"step": 3, "reward/mean": 0.1')  # a crash in the middle of step 3's row
    with pytest.warns(UserWarning, match=r"metrics\.jsonl: dropped a partial last line") as record:
        RLTrainer(rl_config(tmp_path, "trainer.total_steps=3", "trainer.resume=auto", *common)).fit()
    assert len([w for w in record if "partial last line" in str(w.message)]) == 1
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3]
