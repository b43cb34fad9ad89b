"""The reward pool: per-call timeouts (score 0, counted, the reason with the sample), the concurrency limit,
results independent of which call finished first, and the strict errors of serial scoring."""

from __future__ import annotations

import random
import select
import signal
import threading
import time

import pytest
import torch

from verl.config import load_config
from verl.errors import ConfigError, RewardError
from verl.rewards import RewardManager
from verl.rewards.pool import RewardPool

PROMPTS = ["p0", "p1", "p2", "p3"]
GROUND_TRUTHS = ["a", "b", "c", "d"]


@pytest.fixture
def release():
    """An event that hung reward calls wait on; set at the end so their abandoned threads finish."""
    event = threading.Event()
    yield event
    event.set()


def test_a_call_past_the_timeout_scores_zero_with_the_reason(release):
    def slow(prompt, response, ground_truth):
        if response == "hang":
            release.wait(30)
        return 1.0

    manager = RewardManager([slow], timeout_s=0.3)
    start = time.monotonic()
    result = manager.score(PROMPTS, ["ok", "hang", "ok", "ok"], GROUND_TRUTHS)
    took = time.monotonic() - start
    assert took < 0.3 + 1.0, f"the batch waited {took:.2f}s for a call given up after 0.3s"
    assert result.scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert result.metrics["reward/timeouts"] == 1.0 and result.metrics["reward/slow/timeouts"] == 1.0
    assert result.metrics["reward/slow/score"] == pytest.approx(0.75)  # the timed-out sample counts as 0
    extra = result.extras[1]["slow"]
    assert extra["status"] == "timeout" and "reward.timeout_s=0.3" in extra["reason"] and "slow" in extra["reason"]
    assert result.extras[0] == {} and result.applied["slow"].all()


def test_no_timeout_is_logged_as_zero():
    result = RewardManager([lambda prompt, response, ground_truth: 0.5]).score(PROMPTS, ["a"] * 4, GROUND_TRUTHS)
    assert result.metrics["reward/timeouts"] == 0.0
    assert not any(k.endswith("/timeouts") and k != "reward/timeouts" for k in result.metrics)


def test_a_batched_call_past_the_timeout_scores_its_whole_batch_zero(release):
    def judge(prompts, responses, ground_truths, metadatas):
        release.wait(30)
        return [1.0] * len(responses)

    judge.reward_spec = {"batched": True}

    def length(prompt, response, ground_truth):
        return float(len(response))

    result = RewardManager([judge, length], timeout_s=0.2).score(PROMPTS, ["x", "yy", "zzz", ""], GROUND_TRUTHS)
    assert result.scores.tolist() == [1.0, 2.0, 3.0, 0.0]  # the other function still counts
    assert result.metrics["reward/timeouts"] == 4.0 and result.metrics["reward/judge/timeouts"] == 4.0
    assert all(e["judge"]["status"] == "timeout" for e in result.extras)


def test_the_concurrency_limit_holds_and_a_hung_call_gives_up_its_slot(release):
    lock, running, peak = threading.Lock(), [0], [0]

    def counted(prompt, response, ground_truth):
        if response == "hang":
            release.wait(30)
            return 0.0
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.03)
        with lock:
            running[0] -= 1
        return 1.0

    manager = RewardManager([counted], workers=3, timeout_s=0.3)
    manager.score(["p"] * 12, ["r"] * 12, ["g"] * 12)
    assert peak[0] == 3
    # A call that hangs is given up after the timeout and its worker replaced: the next batch still runs 3 at
    # once beside the abandoned thread.
    result = manager.score(["p"] * 4, ["hang", "r", "r", "r"], ["g"] * 4)
    assert result.metrics["reward/timeouts"] == 1.0 and manager.pool.abandoned == 1
    peak[0] = 0
    manager.score(["p"] * 9, ["r"] * 9, ["g"] * 9)
    assert peak[0] == 3


def test_results_do_not_depend_on_which_call_finished_first():
    def jittery(prompt, response, ground_truth, *, seed: int):
        time.sleep(random.Random(seed * 1000 + int(response)).random() * 0.01 + random.random() * 0.005)
        value = int(response) * 0.37 % 1.0
        return {"score": value, "half": float(value > 0.5), "note": f"r{response}"}

    def batched(prompts, responses, ground_truths, metadatas):
        time.sleep(random.random() * 0.01)
        return [len(r) / 3 for r in responses]

    batched.reward_spec = {"batched": True, "weight": 0.5}
    responses = [str(i) for i in range(24)]
    metadata = [{"seed": i % 5} for i in range(24)]
    runs = []
    for workers in (1, 4, 8, 8):
        manager = RewardManager([jittery, batched], workers=workers)
        runs.append(manager.score(["p"] * 24, responses, ["g"] * 24, metadata))
    first = runs[0]
    for other in runs[1:]:
        assert torch.equal(other.scores, first.scores)
        assert list(other.metrics.items()) == list(first.metrics.items())  # the same values in the same order
        assert other.extras == first.extras
        assert all(torch.equal(other.per_function[k], v) for k, v in first.per_function.items())


def test_a_raising_function_stops_the_run_with_the_first_error_in_sample_order():
    def flaky(prompt, response, ground_truth):
        if response == "late":
            time.sleep(0.05)  # raises after sample 3 has raised
            raise ValueError("late failure")
        if response == "early":
            raise KeyError("early failure")
        return 1.0

    manager = RewardManager([flaky], workers=4)
    with pytest.raises(RewardError) as err:
        manager.score(PROMPTS, ["ok", "late", "ok", "early"], GROUND_TRUTHS)
    message = str(err.value)
    assert "reward function 'flaky'" in message and "on sample 1" in message and "late failure" in message
    assert isinstance(err.value.__cause__, ValueError)


def test_a_signal_based_timeout_in_a_reward_function_gets_the_fix():
    def alarmed(prompt, response, ground_truth):
        signal.signal(signal.SIGALRM, lambda *a: None)
        return 1.0

    with pytest.raises(RewardError, match="worker threads .*reward.timeout_s already bounds every call"):
        RewardManager([alarmed]).score(["p"], ["r"], ["g"])


def test_math_verify_runs_on_a_worker_thread():
    pytest.importorskip("math_verify")
    manager = RewardManager([{"name": "math_verify"}])
    result = manager.score(["q", "q"], ["so \\boxed{\\frac{1}{2}}", "\\boxed{3}"], ["0.5", "0.5"])
    assert result.scores.tolist() == [1.0, 0.0]


def test_responses_added_early_score_as_when_given_at_the_end():
    calls = []

    def recorded(prompt, response, ground_truth):
        calls.append(response)
        return float(len(response))

    manager = RewardManager([recorded])
    whole = manager.score(PROMPTS, ["a", "bb", "ccc", "dddd"], GROUND_TRUTHS)
    calls.clear()
    scoring = manager.start(PROMPTS, GROUND_TRUTHS)
    scoring.add([2, 0], ["ccc", "a"])
    scoring.add([1], ["stale"])  # a response that changes before `finish` is scored again
    result = scoring.finish(["a", "bb", "ccc", "dddd"])
    assert torch.equal(result.scores, whole.scores) and result.metrics == whole.metrics
    assert sorted(calls) == ["a", "bb", "ccc", "dddd", "stale"]
    with pytest.raises(RewardError, match="Scoring.finish got .*'responses': 3.* for the 4 samples"):
        manager.start(PROMPTS, GROUND_TRUTHS).finish(["a", "b", "c"])


def test_pool_settings_are_checked():
    with pytest.raises(ConfigError, match="reward.workers must be an integer >= 1"):
        RewardPool(workers=0)
    with pytest.raises(ConfigError, match="reward.timeout_s must be a number of seconds > 0"):
        RewardManager([lambda p, r, g: 1.0], timeout_s=0)
    config = load_config(overrides=["reward.workers=2", "reward.timeout_s=5", "reward.overlap=false"])
    assert (config.reward.workers, config.reward.timeout_s, config.reward.overlap) == (2, 5.0, False)
    with pytest.raises(ConfigError, match="reward.workers"):
        load_config(overrides=["reward.workers=0"])


def test_idle_workers_end():
    """The pool's workers end after `idle_s` without calls, its deadline supervisor once the last call's deadline
    and an idle wait have passed (threads of other tests' pools, still in their own idle time, are not counted)."""
    pool = RewardPool(workers=2, timeout_s=0.5, idle_s=0.05)
    before = set(threading.enumerate())

    def started_here() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in before and t.name.startswith("verl-reward")]

    for call in pool.submit([lambda: 1, lambda: 2, lambda: 3]):
        assert pool.wait(call).value in (1, 2, 3)
    assert {t.name for t in started_here()} == {"verl-reward-worker", "verl-reward-timeouts"}
    deadline = time.monotonic() + 2
    while started_here() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not started_here()


def test_a_copied_manager_gets_a_fresh_pool_with_the_same_settings():
    import copy
    import pickle

    manager = RewardManager([{"name": "exact_match"}], workers=3, timeout_s=7.0)
    for other in (copy.deepcopy(manager), pickle.loads(pickle.dumps(manager))):
        assert other.pool is not manager.pool and (other.pool.workers, other.pool.timeout_s) == (3, 7.0)
        assert other.score(["p"], ["a"], ["b"]).scores.tolist() == [0.0]


def test_a_forked_child_scores_on_threads_of_its_own():
    import os

    manager = RewardManager([{"name": "exact_match"}])
    assert manager.score(["p"], ["a"], ["a"]).scores.tolist() == [1.0]  # the parent's workers exist now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child inherits the pool's state but none of its threads
        ok = False
        try:
            ok = manager.score(["p", "p"], ["a", "b"], ["a", "a"]).scores.tolist() == [1.0, 0.0]
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 20)  # a child waiting on threads it does not have would hang
    got = os.read(read, 1) if ready else b"hung"
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert got == b"1"
