"""reward.executor=process: a worker process that dies in the middle of a call fails only its sample (scored
0, the exit code or signal in its record, counted in reward/worker_crashes, a new worker in its place), up to
reward.max_worker_crashes per step, past which the run stops with a RewardError; a worker that outgrows
reward.max_rss_mb after a call is replaced (counted in reward/worker_replacements), its result kept."""

from __future__ import annotations

import os
import textwrap

import pytest

from verl.config.schema import RewardConfig
from verl.errors import ConfigError, RewardError
from verl.rewards import RewardManager
from verl.rewards.manager import configure_rewards

PROMPTS = ["p0", "p1", "p2", "p3"]
RESPONSES = ["1", "2", "x", "4"]
GROUND_TRUTHS = ["1", "2", "3", "4"]

REWARDS = textwrap.dedent('''
    import os, signal

    def exits(prompt, response, ground_truth, **meta):
        if response == "x":
            os._exit(3)
        return 1.0

    def killed(prompt, response, ground_truth, **meta):
        if response == "x":
            os.kill(os.getpid(), signal.SIGKILL)
        return 1.0

    LEAKED = []

    def leaks(prompt, response, ground_truth, mb=8, **meta):
        LEAKED.append(b"x" * (mb << 20))  # written, so resident
        return float(os.getpid())
''')


@pytest.fixture
def rewards(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    return str(tmp_path / "rewards.py")


def manager(specs, workers=2, **settings):
    m = RewardManager(specs)
    m.configure(workers=workers, timeout_s=30.0, executor="process", **settings)
    return m


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("fn, reason", [("exits", "exit code 3"), ("killed", "signal 9, SIGKILL")])
def test_a_worker_that_dies_mid_call_fails_only_its_sample(rewards, fn, reason):
    m = manager([{"name": f"{rewards}:{fn}"}])
    result = m.score(PROMPTS, RESPONSES, GROUND_TRUTHS)
    assert result.scores.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert result.applied[fn].tolist() == [True] * 4
    record = result.extras[2][fn]
    assert record["status"] == "worker_crashed"
    assert record["reason"] == (f"reward function '{fn}': reward worker died ({reason}) "
                                "while scoring this sample (scored 0)")
    assert result.metrics["reward/worker_crashes"] == 1.0
    assert result.metrics["reward/worker_replacements"] == 0.0
    assert len(m.sample_pool._workers) <= 2
    again = m.score(PROMPTS[:2], RESPONSES[:2], GROUND_TRUTHS[:2])  # the pool goes on, the count starts again
    assert again.scores.tolist() == [1.0, 1.0] and again.metrics["reward/worker_crashes"] == 0.0


def test_more_crashes_than_the_limit_stop_the_run(rewards):
    m = manager([{"name": f"{rewards}:exits"}], max_worker_crashes=1)
    with pytest.raises(RewardError, match=r"reward worker processes died in 2 calls while scoring this step's "
                       r"samples, more than reward.max_worker_crashes=1; the last: reward function 'exits' .* on "
                       r"sample 3: reward worker died \(exit code 3\).*raise reward.max_worker_crashes"):
        m.score(PROMPTS, ["1", "x", "2", "x"], GROUND_TRUTHS)
    # 0: no crash allowed, the first one stops the run
    with pytest.raises(RewardError, match=r"died in 1 calls .*max_worker_crashes=0"):
        manager([{"name": f"{rewards}:exits"}], max_worker_crashes=0).score(PROMPTS, RESPONSES, GROUND_TRUTHS)


def test_a_worker_over_max_rss_mb_is_replaced_and_its_result_kept(rewards):
    m = manager([{"name": f"{rewards}:leaks", "kwargs": {"mb": 64}}], workers=1, max_rss_mb=64)
    result = m.score(PROMPTS[:3], RESPONSES[:3], GROUND_TRUTHS[:3])
    pids = [int(s) for s in result.scores.tolist()]  # each call's result is its worker's pid
    assert len(set(pids)) == 3  # every call pushed its worker past 64 MiB: a fresh one took the next
    assert result.metrics["reward/worker_replacements"] == 3.0
    assert result.metrics["reward/worker_crashes"] == 0.0
    assert all(gone(pid) for pid in pids) and os.getpid() not in pids


def test_without_a_limit_a_leaking_worker_is_kept(rewards):
    m = manager([{"name": f"{rewards}:leaks"}], workers=1, max_rss_mb=0)
    result = m.score(PROMPTS[:3], RESPONSES[:3], GROUND_TRUTHS[:3])
    assert len(set(result.scores.tolist())) == 1
    assert result.metrics["reward/worker_replacements"] == 0.0


def test_the_settings_come_from_the_config_and_are_checked(rewards):
    defaults = RewardConfig()
    m = RewardManager([{"name": f"{rewards}:exits"}])
    assert (m.max_worker_crashes, m.max_rss_mb) == (defaults.max_worker_crashes, defaults.max_rss_mb)
    env = type("Env", (), {"reward_manager": m})()
    configure_rewards(env, workers=1, timeout_s=5.0, executor="process", max_worker_crashes=2, max_rss_mb=512)
    assert m.max_worker_crashes == 2 and m.sample_pool.max_rss_mb == 512
    m.sample_pool.close()
    with pytest.raises(ConfigError, match="reward.max_worker_crashes must be an integer >= 0"):
        m.configure(max_worker_crashes=-1)
    with pytest.raises(ConfigError, match="reward.max_rss_mb must be a number of MiB >= 0"):
        m.configure(max_rss_mb=-5)


def test_threads_log_the_same_metric_keys_at_zero():
    m = RewardManager([{"name": "numeric_match"}])
    m.configure(executor="thread")
    metrics = m.score(PROMPTS, RESPONSES, GROUND_TRUTHS).metrics
    assert metrics["reward/worker_crashes"] == 0.0 and metrics["reward/worker_replacements"] == 0.0
